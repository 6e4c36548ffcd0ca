//! Compiles the kernel crate `device/` to PTX with rustc's own nvptx64
//! backend, assembles SASS from it with ptxas, and embeds both, compressed,
//! in the library.
//!
//! Architectures: `P2P_ALLREDUCE_ARCHS` lists the SASS architectures
//! (default `sm_120,sm_103,sm_100,sm_90,sm_80`). The PTX is built once per
//! major version, for the lowest minor listed (sm_120, sm_100, sm_90,
//! sm_80 by default), and each listed architecture's SASS is assembled from
//! its major's PTX: sm_103's from sm_100's, which rustc's backend compiles
//! with sm_100's instructions (rustc does not know sm_103 as a target
//! feature, so a PTX built for it would lose the sm_90 paths).
//!
//! Outputs:
//! - `$OUT_DIR/<ptx arch>.ptx`, `$OUT_DIR/<arch>.cubin` (when ptxas is
//!   found), each also compressed (`.zst`, the container of
//!   `host/image_format.rs`), and `$OUT_DIR/ptx_modules.rs` (the embedded
//!   table, with every PTX text's entry index);
//! - `<target dir>/ptx/<ptx arch>.ptx`, a copy for users who want the files;
//! - `$OUT_DIR/kernel_resources.rs`, the register and spill counts of every
//!   entry on every SASS architecture (empty without ptxas; `info` says so).
//!
//! Assembled and compressed images are cached under
//! `<target dir>/ptx-build/images/` by content, so a second build of the
//! same kernels (another feature set, the Python extension) reuses them.
//!
//! Environment:
//! - `P2P_ALLREDUCE_ARCHS`: comma-separated SASS architectures;
//! - `P2P_ALLREDUCE_NVPTX_RUSTC` / `P2P_ALLREDUCE_NVPTX_CARGO`: the toolchain
//!   for the kernel build (must have the library source for `-Zbuild-std`);
//! - `P2P_ALLREDUCE_PTXAS`: the ptxas to use (`none`: embed no SASS).

use std::env;
use std::fmt::Write as _;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

#[path = "host/ptxas.rs"]
#[allow(dead_code)]
mod ptxas;

#[path = "host/image_format.rs"]
#[allow(dead_code)]
mod image_format;

const DEFAULT_ARCHS: &str = "sm_120,sm_103,sm_100,sm_90,sm_80";
/// zstd level of the embedded images (19: about 11x on cubins, 20x on PTX).
const ZSTD_LEVEL: i32 = 19;

/// One SASS architecture and the PTX its cubin is assembled from.
#[derive(Clone, Debug)]
struct Arch {
    name: String,
    cc: (u32, u32),
    /// The lowest listed architecture of the same major.
    ptx: String,
}

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
    // The kernel crate's sources: where the kernel crate says they are
    // (its build.rs, through `links`: the registry's copy when both crates
    // come from crates.io, whose package of this crate cannot carry them),
    // else `device/` next to this file.
    let device_dir = env::var_os("DEP_P2P_ALLREDUCE_DEVICE_ROOT")
        .map(PathBuf::from)
        .unwrap_or_else(|| root.join("device"));
    println!(
        "cargo:rerun-if-changed={}",
        device_dir.join("src").display()
    );
    println!(
        "cargo:rerun-if-changed={}",
        device_dir.join("Cargo.toml").display()
    );
    println!("cargo:rerun-if-changed=host/ptxas.rs");
    println!("cargo:rerun-if-changed=host/image_format.rs");
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
    let ptx_archs = ptx_archs(&archs);
    let tc = find_toolchain();
    for a in &ptx_archs {
        check_rustc_knows(&tc, a, &archs);
    }
    let target_dir = cargo_target_dir(&out_dir);
    let nested_target = target_dir.join("ptx-build");
    let cache = nested_target.join("images");
    let public_dir = target_dir.join("ptx");
    fs::create_dir_all(&public_dir).expect("create target/ptx");
    fs::create_dir_all(&cache).expect("create the image cache");

    for arch in &ptx_archs {
        let ptx = out_dir.join(format!("{arch}.ptx"));
        build_ptx(&tc, &device_dir, &nested_target, arch, &ptx);
        fs::copy(&ptx, public_dir.join(format!("{arch}.ptx"))).expect("copy PTX to target/ptx");
    }

    let sass = write_resources(&root, &out_dir, &cache, &archs);
    let mut images: Vec<String> = ptx_archs.iter().map(|a| format!("{a}.ptx")).collect();
    if sass {
        images.extend(archs.iter().map(|a| format!("{}.cubin", a.name)));
    }
    compress_all(&out_dir, &cache, &images);
    write_module_table(&out_dir, &archs, &ptx_archs, &tc, sass);
}

/// "sm_120,sm_103" -> the SASS architectures, each with the PTX it is
/// assembled from (the lowest listed minor of its major).
fn parse_archs(list: &str) -> Vec<Arch> {
    let mut v: Vec<Arch> = Vec::new();
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
        if v.iter().all(|x| x.name != a) {
            v.push(Arch {
                name: a.to_string(),
                cc: (n / 10, n % 10),
                ptx: String::new(),
            });
        }
    }
    assert!(!v.is_empty(), "P2P_ALLREDUCE_ARCHS is empty");
    let lowest: Vec<(u32, String)> = v
        .iter()
        .map(|a| {
            let low = v
                .iter()
                .filter(|b| b.cc.0 == a.cc.0)
                .min_by_key(|b| b.cc.1)
                .expect("a itself");
            (a.cc.0, low.name.clone())
        })
        .collect();
    for (a, (_, low)) in v.iter_mut().zip(lowest) {
        a.ptx = low;
    }
    v
}

/// The PTX architectures, in the order their majors first appear.
fn ptx_archs(archs: &[Arch]) -> Vec<String> {
    let mut v: Vec<String> = Vec::new();
    for a in archs {
        if !v.contains(&a.ptx) {
            v.push(a.ptx.clone());
        }
    }
    v
}

/// rustc must know `arch` as a target feature: the kernels select code
/// with `cfg(target_feature = "sm_90")`, which rustc leaves unset for a
/// target CPU it does not know (sm_103 in rustc 1.96), silently dropping
/// the sm_90 paths.
fn check_rustc_knows(tc: &Toolchain, arch: &str, archs: &[Arch]) {
    let out = Command::new(&tc.rustc)
        .env("RUSTC_BOOTSTRAP", "1")
        .args(["--print", "cfg", "--target", "nvptx64-nvidia-cuda"])
        .arg(format!("-Ctarget-cpu={arch}"))
        .output()
        .unwrap_or_else(|e| panic!("could not run {}: {e}", tc.rustc.display()));
    let text = String::from_utf8_lossy(&out.stdout);
    if !text.contains(&format!("target_feature=\"{arch}\"")) {
        let users: Vec<&str> = archs
            .iter()
            .filter(|a| a.ptx == arch)
            .map(|a| a.name.as_str())
            .collect();
        panic!(
            "\n\np2p-allreduce: the PTX for {} would be built for {arch}, but {} does not know {arch} as a \
             target feature (its cfg would leave out the kernels' sm_90 code). Add a lower architecture of \
             the same major that rustc knows to P2P_ALLREDUCE_ARCHS (e.g. sm_100 for sm_103): its PTX is \
             then assembled into {arch}'s SASS.\n",
            users.join(", "),
            tc.rustc.display()
        );
    }
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
    // jobserver must not leak into the nested kernel build; nor the C
    // toolchain settings of an outer cross build (maturin's zig sets
    // CC_<target>, TARGET_CC, ...), which the standard library's build
    // scripts read: they would rebuild core and every kernel.
    let c_toolchain = |k: &str| {
        k == "LD"
            || [
                "CC", "CXX", "AR", "CFLAGS", "CXXFLAGS", "ARFLAGS", "LDFLAGS", "CPPFLAGS",
            ]
            .iter()
            .any(|v| k == *v || k.starts_with(&format!("{v}_")))
            || k.starts_with("TARGET_")
            || k.starts_with("HOST_")
            || k.starts_with("CRATE_CC_")
    };
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
            || c_toolchain(&k)
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

/// Maps `f` over `items` on up to `NUM_JOBS` (cargo's -j) threads,
/// keeping the order.
fn par_map<T: Sync, R: Send>(items: &[T], f: impl Fn(&T) -> R + Sync) -> Vec<R> {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Mutex;
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let jobs = env::var("NUM_JOBS")
        .ok()
        .and_then(|j| j.parse::<usize>().ok())
        .unwrap_or(cores);
    let workers = cores.min(jobs).min(items.len()).max(1);
    let next = AtomicUsize::new(0);
    let results: Mutex<Vec<Option<R>>> = Mutex::new((0..items.len()).map(|_| None).collect());
    std::thread::scope(|s| {
        for _ in 0..workers {
            s.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= items.len() {
                    break;
                }
                let r = f(&items[i]);
                results.lock().expect("no worker panicked")[i] = Some(r);
            });
        }
    });
    results
        .into_inner()
        .expect("no worker panicked")
        .into_iter()
        .map(|r| r.expect("every item mapped"))
        .collect()
}

/// Writes `bytes` to `path` through a temporary file and a rename, so a
/// concurrent build never reads half a cache entry.
fn write_atomic(path: &Path, bytes: &[u8]) {
    let tmp = path.with_extension(format!(
        "tmp{}-{:?}",
        std::process::id(),
        std::thread::current().id()
    ));
    fs::write(&tmp, bytes).unwrap_or_else(|e| panic!("write {}: {e}", tmp.display()));
    fs::rename(&tmp, path).unwrap_or_else(|e| panic!("rename to {}: {e}", path.display()));
}

/// A cache entry, if present; marks it as used now (for [`prune_cache`]).
fn cache_get(path: &Path) -> Option<Vec<u8>> {
    let bytes = fs::read(path).ok()?;
    if let Ok(f) = fs::File::options().append(true).open(path) {
        let _ = f.set_modified(std::time::SystemTime::now());
    }
    Some(bytes)
}

/// Keeps the cache to the most recently used entries: a few builds' worth.
fn prune_cache(cache: &Path) {
    const KEEP: usize = 80;
    let Ok(dir) = fs::read_dir(cache) else { return };
    let mut files: Vec<(std::time::SystemTime, PathBuf)> = dir
        .filter_map(|e| {
            let e = e.ok()?;
            Some((e.metadata().ok()?.modified().ok()?, e.path()))
        })
        .collect();
    files.sort_by_key(|f| std::cmp::Reverse(f.0));
    for (_, p) in files.into_iter().skip(KEEP) {
        let _ = fs::remove_file(p);
    }
}

/// Assembles every SASS architecture from its PTX with ptxas (or takes
/// the cubin and report from the cache), keeping the cubins in OUT_DIR and
/// writing their `-v` numbers. Returns whether the cubins exist (ptxas was
/// found).
fn write_resources(root: &Path, out_dir: &Path, cache: &Path, archs: &[Arch]) -> bool {
    let mut s = String::from("// Generated by build.rs from `ptxas -v`.\n");
    let Some(p) = ptxas::find_ptxas(root) else {
        println!("cargo:warning=ptxas not found: no SASS is embedded (devices JIT-compile the PTX) and register/spill counts are not recorded (run scripts/setup.sh or set P2P_ALLREDUCE_PTXAS)");
        s.push_str("pub const PTXAS_USED: Option<&str> = None;\n");
        s.push_str("pub const PTXAS_VERSION: Option<&str> = None;\n");
        s.push_str("pub static KERNEL_STATS: &[(&str, KernelStats)] = &[];\n");
        fs::write(out_dir.join("kernel_resources.rs"), s).expect("write kernel_resources.rs");
        return false;
    };
    let version = ptxas::version(&p)
        .unwrap_or_else(|| panic!("{} does not run (`--version` failed)", p.display()));
    let reports = par_map(archs, |a| {
        let ptx = out_dir.join(format!("{}.ptx", a.ptx));
        let cubin = out_dir.join(format!("{}.cubin", a.name));
        let text = fs::read(&ptx).unwrap_or_else(|e| panic!("read {}: {e}", ptx.display()));
        let key = image_format::fnv1a(&[&text, a.name.as_bytes(), version.as_bytes()]);
        let cached_cubin = cache.join(format!("{key:016x}-{}.cubin", a.name));
        let cached_report = cache.join(format!("{key:016x}-{}.ptxas-v", a.name));
        let hit = cache_get(&cached_cubin).zip(cache_get(&cached_report));
        let report = match hit {
            Some((bin, report)) => {
                fs::write(&cubin, bin).expect("write cubin");
                String::from_utf8(report).expect("cached ptxas report is text")
            }
            None => {
                let report = ptxas::assemble_report(&p, &ptx, &a.name, &cubin)
                    .unwrap_or_else(|e| panic!("{e}"));
                write_atomic(&cached_cubin, &fs::read(&cubin).expect("read cubin"));
                write_atomic(&cached_report, report.as_bytes());
                report
            }
        };
        ptxas::parse_report(&report)
    });
    let _ = writeln!(
        s,
        "pub const PTXAS_USED: Option<&str> = Some({:?});",
        p.display().to_string()
    );
    let _ = writeln!(
        s,
        "/// The ptxas release that assembled the cubins.\npub const PTXAS_VERSION: Option<&str> = Some({:?});",
        version
            .lines()
            .find(|l| l.contains("release"))
            .unwrap_or(version.lines().last().unwrap_or(""))
            .trim()
    );
    s.push_str("pub static KERNEL_STATS: &[(&str, KernelStats)] = &[\n");
    for (a, report) in archs.iter().zip(reports) {
        for k in report {
            let _ = writeln!(
                s,
                "    ({:?}, KernelStats {{ entry: {:?}, registers: {}, stack_frame_bytes: {}, spill_store_bytes: {}, spill_load_bytes: {} }}),",
                a.name, k.entry, k.registers, k.stack_frame_bytes, k.spill_store_bytes, k.spill_load_bytes
            );
        }
    }
    s.push_str("];\n");
    fs::write(out_dir.join("kernel_resources.rs"), s).expect("write kernel_resources.rs");
    true
}

/// Compresses each `OUT_DIR/<image>` into `OUT_DIR/<image>.zst` (the
/// container of `host/image_format.rs`: zstd frames of at most
/// `CHUNK_BYTES`, compressed in parallel), or takes it from the cache.
fn compress_all(out_dir: &Path, cache: &Path, images: &[String]) {
    let raws: Vec<Vec<u8>> = images
        .iter()
        .map(|name| fs::read(out_dir.join(name)).unwrap_or_else(|e| panic!("read {name}: {e}")))
        .collect();
    let settings = format!("zstd {ZSTD_LEVEL} chunk {}", image_format::CHUNK_BYTES);
    let keyed: Vec<PathBuf> = images
        .iter()
        .zip(&raws)
        .map(|(name, raw)| {
            let key = image_format::fnv1a(&[raw, settings.as_bytes()]);
            cache.join(format!("{key:016x}-{name}.zst"))
        })
        .collect();
    let mut jobs: Vec<(usize, usize)> = Vec::new(); // (image, chunk)
    for (i, cached) in keyed.iter().enumerate() {
        if let Some(blob) = cache_get(cached) {
            fs::write(out_dir.join(format!("{}.zst", images[i])), blob).expect("write .zst");
        } else {
            let chunks = raws[i].len().div_ceil(image_format::CHUNK_BYTES).max(1);
            jobs.extend((0..chunks).map(|c| (i, c)));
        }
    }
    let frames = par_map(&jobs, |&(i, c)| {
        let raw = &raws[i];
        let from = (c * image_format::CHUNK_BYTES).min(raw.len());
        let to = ((c + 1) * image_format::CHUNK_BYTES).min(raw.len());
        let frame = zstd::bulk::compress(&raw[from..to], ZSTD_LEVEL)
            .unwrap_or_else(|e| panic!("zstd on {}: {e}", images[i]));
        (frame, to - from)
    });
    let mut at = 0;
    while at < jobs.len() {
        let i = jobs[at].0;
        let n = jobs[at..].iter().take_while(|j| j.0 == i).count();
        let blob = image_format::write_container(&frames[at..at + n]);
        write_atomic(&keyed[i], &blob);
        fs::write(out_dir.join(format!("{}.zst", images[i])), blob).expect("write .zst");
        at += n;
    }
    prune_cache(cache);
}

fn write_module_table(
    out_dir: &Path,
    archs: &[Arch],
    ptx_archs: &[String],
    tc: &Toolchain,
    sass: bool,
) {
    let ident = |name: &str| name.to_uppercase();
    let raw_len = |file: &str| {
        fs::metadata(out_dir.join(file))
            .unwrap_or_else(|e| panic!("{file}: {e}"))
            .len()
    };
    let mut s = String::new();
    s.push_str("// Generated by build.rs.\n");
    for arch in ptx_archs {
        let file = format!("{arch}.ptx");
        let text = fs::read_to_string(out_dir.join(&file)).expect("read PTX");
        let layout = image_format::ptx_layout(&text)
            .unwrap_or_else(|e| panic!("PTX for {arch}: cannot index its entries: {e}"));
        let mut entries = layout.entries.clone();
        entries.sort_by(|a, b| a.0.cmp(&b.0));
        let _ = writeln!(
            s,
            "/// PTX of every kernel, compiled for `{arch}` (compressed), with its entry index.\n\
             static PTX_{id}: PtxImage = PtxImage::new(\n    Image::new(include_bytes!(concat!(env!(\"OUT_DIR\"), \"/{file}.zst\")), {len}),\n    &[{common}],\n    &[",
            id = ident(arch),
            len = raw_len(&file),
            common = layout
                .common
                .iter()
                .map(|r| format!("({}, {})", r.start, r.end))
                .collect::<Vec<_>>()
                .join(", ")
        );
        for (name, r) in entries {
            let _ = writeln!(s, "        ({name:?}, {}, {}),", r.start, r.end);
        }
        s.push_str("    ],\n);\n");
    }
    if sass {
        for a in archs {
            let file = format!("{}.cubin", a.name);
            let _ = writeln!(
                s,
                "/// SASS of every kernel for exactly `{arch}` (`ptxas -arch={arch}` on the {ptx} PTX, compressed).\n\
                 static CUBIN_{id}: Image = Image::new(include_bytes!(concat!(env!(\"OUT_DIR\"), \"/{file}.zst\")), {len});",
                arch = a.name,
                ptx = a.ptx,
                id = ident(&a.name),
                len = raw_len(&file)
            );
        }
    }
    s.push_str("/// Every embedded module, one per SASS architecture, in the order listed at build time.\n");
    s.push_str("pub static MODULES: &[PtxModule] = &[\n");
    for a in archs {
        let cubin = if sass {
            format!("Some(&CUBIN_{})", ident(&a.name))
        } else {
            "None".to_string()
        };
        let _ = writeln!(
            s,
            "    PtxModule {{ arch: {:?}, compute_capability: ({}, {}), ptx_arch: {:?}, ptx_image: &PTX_{}, cubin_image: {cubin} }},",
            a.name,
            a.cc.0,
            a.cc.1,
            a.ptx,
            ident(&a.ptx)
        );
    }
    s.push_str("];\n");
    let _ = writeln!(
        s,
        "/// Which toolchain compiled the kernels.\npub const KERNEL_TOOLCHAIN: &str = {:?};",
        format!("{} ({})", tc.origin, tc.rustc.display())
    );
    let _ = writeln!(
        s,
        "/// How the embedded images are compressed.\npub const IMAGE_COMPRESSION: &str = {:?};",
        format!(
            "zstd level {ZSTD_LEVEL}, {} MiB chunks",
            image_format::CHUNK_BYTES >> 20
        )
    );
    fs::write(out_dir.join("ptx_modules.rs"), s).expect("write ptx_modules.rs");
}
