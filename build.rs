//! Compiles the kernel crate `device/` to PTX, once per architecture, with
//! rustc's own nvptx64 backend, and embeds the result in the library.
//!
//! Outputs:
//! - `$OUT_DIR/<arch>.ptx` and `$OUT_DIR/ptx_modules.rs` (the embedded table);
//! - `<target dir>/ptx/<arch>.ptx`, a copy for users who want the files;
//! - when ptxas is found, `$OUT_DIR/<arch>.cubin` (SASS for exactly that
//!   architecture, embedded next to the PTX so that a matching device loads it
//!   without the driver's JIT) and `$OUT_DIR/kernel_resources.rs` with the
//!   register and spill counts of every entry (empty otherwise, and `info`
//!   says so).
//!
//! Environment:
//! - `P2P_ALLREDUCE_ARCHS`: comma-separated list, default `sm_120,sm_90,sm_80`;
//! - `P2P_ALLREDUCE_NVPTX_RUSTC` / `P2P_ALLREDUCE_NVPTX_CARGO`: the toolchain
//!   for the kernel build (must have the library source for `-Zbuild-std`);
//! - `P2P_ALLREDUCE_PTXAS`: the ptxas to use.

use std::env;
use std::fmt::Write as _;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

#[path = "host/ptxas.rs"]
#[allow(dead_code)]
mod ptxas;

const DEFAULT_ARCHS: &str = "sm_120,sm_90,sm_80";

struct Toolchain {
    rustc: PathBuf,
    cargo: PathBuf,
    /// Keep RUSTUP_TOOLCHAIN for a rustup-managed toolchain; drop it otherwise.
    rustup: bool,
    origin: &'static str,
}

fn main() {
    let root =
        PathBuf::from(env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"));
    let out_dir = PathBuf::from(env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    println!("cargo:rerun-if-changed=device/src");
    println!("cargo:rerun-if-changed=device/Cargo.toml");
    println!("cargo:rerun-if-changed=host/ptxas.rs");
    for var in [
        "P2P_ALLREDUCE_ARCHS",
        "P2P_ALLREDUCE_NVPTX_RUSTC",
        "P2P_ALLREDUCE_NVPTX_CARGO",
        "P2P_ALLREDUCE_PTXAS",
    ] {
        println!("cargo:rerun-if-env-changed={var}");
    }

    let archs =
        parse_archs(&env::var("P2P_ALLREDUCE_ARCHS").unwrap_or_else(|_| DEFAULT_ARCHS.into()));
    let tc = find_toolchain();
    let target_dir = cargo_target_dir(&out_dir);
    let nested_target = target_dir.join("ptx-build");
    let public_dir = target_dir.join("ptx");
    fs::create_dir_all(&public_dir).expect("create target/ptx");

    for (arch, _) in &archs {
        let ptx = out_dir.join(format!("{arch}.ptx"));
        build_ptx(&tc, &root.join("device"), &nested_target, arch, &ptx);
        fs::copy(&ptx, public_dir.join(format!("{arch}.ptx"))).expect("copy PTX to target/ptx");
    }

    let sass = write_resources(&root, &out_dir, &archs);
    write_module_table(&out_dir, &archs, &tc, sass);
}

/// "sm_120" -> (name, compute capability (12, 0)).
fn parse_archs(list: &str) -> Vec<(String, (u32, u32))> {
    let mut v = Vec::new();
    for a in list.split(',').map(str::trim).filter(|a| !a.is_empty()) {
        let digits = a.strip_prefix("sm_").unwrap_or_else(|| {
            panic!("P2P_ALLREDUCE_ARCHS: `{a}` is not of the form sm_XY (e.g. sm_90)")
        });
        let n: u32 = digits.parse().unwrap_or_else(|_| {
            panic!("P2P_ALLREDUCE_ARCHS: `{a}` is not of the form sm_XY (e.g. sm_90)")
        });
        assert!(
            n >= 70,
            "P2P_ALLREDUCE_ARCHS: `{a}`: the kernels need sm_70 or newer (acquire/release flags)"
        );
        v.push((a.to_string(), (n / 10, n % 10)));
    }
    assert!(!v.is_empty(), "P2P_ALLREDUCE_ARCHS is empty");
    v
}

fn has_library_source(rustc: &Path) -> bool {
    let Ok(out) = Command::new(rustc).arg("--print").arg("sysroot").output() else {
        return false;
    };
    if !out.status.success() {
        return false;
    }
    let sysroot = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    sysroot
        .join("lib/rustlib/src/rust/library/core/src/lib.rs")
        .is_file()
}

fn find_toolchain() -> Toolchain {
    // 1. Explicit override.
    if let Ok(rustc) = env::var("P2P_ALLREDUCE_NVPTX_RUSTC") {
        let rustc = PathBuf::from(rustc);
        let cargo = env::var("P2P_ALLREDUCE_NVPTX_CARGO")
            .map(PathBuf::from)
            .unwrap_or_else(|_| rustc.with_file_name("cargo"));
        assert!(
            has_library_source(&rustc),
            "P2P_ALLREDUCE_NVPTX_RUSTC={} has no library source (lib/rustlib/src/rust/library) in its sysroot; \
             -Zbuild-std=core needs it",
            rustc.display()
        );
        return Toolchain {
            rustc,
            cargo,
            rustup: false,
            origin: "P2P_ALLREDUCE_NVPTX_RUSTC",
        };
    }
    // 2. The active toolchain, if it has rust-src.
    let rustc = PathBuf::from(env::var("RUSTC").unwrap_or_else(|_| "rustc".into()));
    let cargo = PathBuf::from(env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    if has_library_source(&rustc) {
        return Toolchain {
            rustc,
            cargo,
            rustup: true,
            origin: "active toolchain (rust-src)",
        };
    }
    // 3. Debian's rustc-web + rust-web-src.
    let deb = PathBuf::from("/usr/bin/rustc");
    if deb.is_file() && has_library_source(&deb) && Path::new("/usr/bin/cargo").is_file() {
        return Toolchain {
            rustc: deb,
            cargo: PathBuf::from("/usr/bin/cargo"),
            rustup: false,
            origin: "Debian rustc-web + rust-web-src",
        };
    }
    panic!(
        "\n\np2p-allreduce: no Rust toolchain with the standard library source was found, so the GPU \
         kernels cannot be compiled to PTX (-Zbuild-std=core needs lib/rustlib/src).\n\
         Install one of:\n\
         \x20 - Debian/Ubuntu: sudo apt-get install -y rustc-web cargo-web rust-web-src   (or run scripts/setup.sh)\n\
         \x20 - rustup:        rustup component add rust-src\n\
         or point P2P_ALLREDUCE_NVPTX_RUSTC (and P2P_ALLREDUCE_NVPTX_CARGO) at such a toolchain.\n"
    );
}

/// OUT_DIR is `<target>/[<triple>/]<profile>/build/<pkg>-<hash>/out`; the
/// target directory is the first ancestor holding cargo's CACHEDIR.TAG.
fn cargo_target_dir(out_dir: &Path) -> PathBuf {
    if let Ok(dir) = env::var("CARGO_TARGET_DIR") {
        return PathBuf::from(dir);
    }
    out_dir
        .ancestors()
        .skip(4)
        .find(|p| p.join("CACHEDIR.TAG").is_file())
        .unwrap_or_else(|| {
            out_dir
                .ancestors()
                .nth(4)
                .expect("OUT_DIR has a target dir")
        })
        .to_path_buf()
}

fn build_ptx(tc: &Toolchain, device_dir: &Path, nested_target: &Path, arch: &str, ptx: &Path) {
    let mut cmd = Command::new(&tc.cargo);
    // A clean environment: the outer build's flags, wrappers, target and
    // jobserver must not leak into the nested kernel build.
    for (k, _) in env::vars_os() {
        let k = k.to_string_lossy().into_owned();
        let keep = k == "CARGO_HOME"
            || k == "CARGO_NET_OFFLINE"
            || k.starts_with("CARGO_REGISTRIES")
            || k.starts_with("CARGO_HTTP");
        if (k.starts_with("CARGO_") && !keep)
            || k.starts_with("RUSTC")
            || k.starts_with("RUSTDOC")
            || k == "RUSTFLAGS"
            || k == "MAKEFLAGS"
            || k == "MFLAGS"
            || (k == "RUSTUP_TOOLCHAIN" && !tc.rustup)
        {
            cmd.env_remove(&k);
        }
    }
    cmd.env("RUSTC", &tc.rustc)
        // Only this nested build uses unstable features (-Zbuild-std, abi_ptx, asm on nvptx).
        .env("RUSTC_BOOTSTRAP", "1")
        // MIR jump threading can duplicate bar.sync into divergent branches.
        .env("RUSTFLAGS", "-Zmir-enable-passes=-JumpThreading")
        .current_dir(device_dir)
        .args([
            "rustc",
            "--release",
            "--lib",
            "--target",
            "nvptx64-nvidia-cuda",
            "-Zbuild-std=core",
        ])
        .arg("--manifest-path")
        .arg(device_dir.join("Cargo.toml"))
        .arg("--target-dir")
        .arg(nested_target)
        .arg("--")
        .arg(format!("--emit=asm={}", ptx.display()))
        .arg(format!("-Ctarget-cpu={arch}"));
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("could not run {}: {e}", tc.cargo.display()));
    if !out.status.success() {
        panic!(
            "kernel build for {arch} failed (toolchain: {}, {}):\n{}\n{}",
            tc.origin,
            tc.rustc.display(),
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let text = fs::read_to_string(ptx)
        .unwrap_or_else(|e| panic!("kernel build left no PTX at {}: {e}", ptx.display()));
    assert!(
        text.lines().any(|l| l.trim() == format!(".target {arch}")),
        "PTX for {arch} does not declare `.target {arch}`"
    );
    // A kernel crate that compiles to no entry at all (a module left out)
    // must fail here, not at the first launch.
    assert!(
        text.contains(".entry "),
        "PTX for {arch} has no kernel entry: the kernel crate built without its kernels"
    );
}

fn write_module_table(out_dir: &Path, archs: &[(String, (u32, u32))], tc: &Toolchain, sass: bool) {
    let mut s = String::new();
    s.push_str("// Generated by build.rs.\n");
    for (arch, _) in archs {
        let _ = writeln!(
            s,
            "/// PTX of every kernel, compiled for `{arch}`.\npub const PTX_{}: &str = include_str!(concat!(env!(\"OUT_DIR\"), \"/{arch}.ptx\"));",
            arch.to_uppercase()
        );
        if sass {
            let _ = writeln!(
                s,
                "/// SASS of every kernel for exactly `{arch}` (`ptxas -arch={arch}`), aligned for the driver's ELF reader.\nstatic CUBIN_{}: Aligned<[u8; include_bytes!(concat!(env!(\"OUT_DIR\"), \"/{arch}.cubin\")).len()]> = Aligned(*include_bytes!(concat!(env!(\"OUT_DIR\"), \"/{arch}.cubin\")));",
                arch.to_uppercase()
            );
        }
    }
    s.push_str("/// Every PTX module this build embeds, newest architecture first as listed at build time.\n");
    s.push_str("pub static MODULES: &[PtxModule] = &[\n");
    for (arch, (maj, min)) in archs {
        let cubin = if sass {
            format!("Some(&CUBIN_{}.0)", arch.to_uppercase())
        } else {
            "None".to_string()
        };
        let _ = writeln!(
            s,
            "    PtxModule {{ arch: \"{arch}\", compute_capability: ({maj}, {min}), ptx: PTX_{}, cubin: {cubin} }},",
            arch.to_uppercase()
        );
    }
    s.push_str("];\n");
    let _ = writeln!(
        s,
        "/// Which toolchain compiled the kernels.\npub const KERNEL_TOOLCHAIN: &str = {:?};",
        format!("{} ({})", tc.origin, tc.rustc.display())
    );
    fs::write(out_dir.join("ptx_modules.rs"), s).expect("write ptx_modules.rs");
}

/// Assembles every architecture's PTX with ptxas (all at once: each takes
/// tens of seconds), keeping the cubins and writing their `-v` numbers.
/// Returns whether the cubins exist (ptxas was found).
fn write_resources(root: &Path, out_dir: &Path, archs: &[(String, (u32, u32))]) -> bool {
    let mut s = String::from("// Generated by build.rs from `ptxas -v`.\n");
    let Some(p) = ptxas::find_ptxas(root) else {
        println!("cargo:warning=ptxas not found: no SASS is embedded (devices JIT-compile the PTX) and register/spill counts are not recorded (run scripts/setup.sh or set P2P_ALLREDUCE_PTXAS)");
        s.push_str("pub const PTXAS_USED: Option<&str> = None;\n");
        s.push_str("pub static KERNEL_STATS: &[(&str, KernelStats)] = &[];\n");
        fs::write(out_dir.join("kernel_resources.rs"), s).expect("write kernel_resources.rs");
        return false;
    };
    let reports: Vec<_> = std::thread::scope(|scope| {
        let jobs: Vec<_> = archs
            .iter()
            .map(|(arch, _)| {
                let p = &p;
                scope.spawn(move || {
                    let ptx = out_dir.join(format!("{arch}.ptx"));
                    let cubin = out_dir.join(format!("{arch}.cubin"));
                    ptxas::assemble_into(p, &ptx, arch, &cubin).unwrap_or_else(|e| panic!("{e}"))
                })
            })
            .collect();
        jobs.into_iter()
            .map(|j| j.join().expect("ptxas thread"))
            .collect()
    });
    let _ = writeln!(
        s,
        "pub const PTXAS_USED: Option<&str> = Some({:?});",
        p.display().to_string()
    );
    s.push_str("pub static KERNEL_STATS: &[(&str, KernelStats)] = &[\n");
    for ((arch, _), report) in archs.iter().zip(reports) {
        for k in report {
            let _ = writeln!(
                s,
                "    ({arch:?}, KernelStats {{ entry: {:?}, registers: {}, stack_frame_bytes: {}, spill_store_bytes: {}, spill_load_bytes: {} }}),",
                k.entry, k.registers, k.stack_frame_bytes, k.spill_store_bytes, k.spill_load_bytes
            );
        }
    }
    s.push_str("];\n");
    fs::write(out_dir.join("kernel_resources.rs"), s).expect("write kernel_resources.rs");
    true
}
