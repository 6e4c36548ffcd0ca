//! Finding `ptxas` and reading its `-v` report. Plain std, because build.rs
//! includes this file too (`#[path]`), to record register and spill counts
//! of the kernels it builds.

use std::path::{Path, PathBuf};
use std::process::Command;

/// Resources of one kernel as reported by `ptxas -v`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct KernelResources {
    pub entry: String,
    pub registers: u32,
    pub stack_frame_bytes: u32,
    pub spill_store_bytes: u32,
    pub spill_load_bytes: u32,
}

/// Where to look for ptxas, in order: `$P2P_ALLREDUCE_PTXAS`, the copy that
/// `scripts/setup.sh` unpacks under `.tools/` of the crate root, `$CUDA_HOME/bin`,
/// then `PATH`.
pub fn find_ptxas(crate_root: &Path) -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("P2P_ALLREDUCE_PTXAS") {
        let p = PathBuf::from(p);
        return p.is_file().then_some(p);
    }
    let mut candidates = vec![crate_root.join(".tools/cuda-nvcc/nvidia/cuda_nvcc/bin/ptxas")];
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Some(h) = std::env::var_os(var) {
            candidates.push(PathBuf::from(h).join("bin/ptxas"));
        }
    }
    candidates.push(PathBuf::from("/usr/local/cuda/bin/ptxas"));
    if let Some(path) = std::env::var_os("PATH") {
        candidates.extend(std::env::split_paths(&path).map(|d| d.join("ptxas")));
    }
    candidates.into_iter().find(|p| p.is_file())
}

/// Assembles `ptx_file` for `arch` (e.g. "sm_90") with `-v` and returns the
/// per-entry report. An assembler error is returned with its message.
pub fn assemble(ptxas: &Path, ptx_file: &Path, arch: &str) -> Result<Vec<KernelResources>, String> {
    let discard = Path::new(if cfg!(windows) { "NUL" } else { "/dev/null" });
    assemble_into(ptxas, ptx_file, arch, discard)
}

/// [`assemble`], keeping the assembled image (a cubin: SASS for exactly
/// `arch`) at `cubin`.
pub fn assemble_into(
    ptxas: &Path,
    ptx_file: &Path,
    arch: &str,
    cubin: &Path,
) -> Result<Vec<KernelResources>, String> {
    assemble_report(ptxas, ptx_file, arch, cubin).map(|text| parse_report(&text))
}

/// [`assemble_into`], returning the `-v` report as text (for
/// [`parse_report`]; build.rs caches it with the cubin).
pub fn assemble_report(
    ptxas: &Path,
    ptx_file: &Path,
    arch: &str,
    cubin: &Path,
) -> Result<String, String> {
    let out = Command::new(ptxas)
        .arg(format!("-arch={arch}"))
        .arg("-v")
        .arg(ptx_file)
        .arg("-o")
        .arg(cubin)
        .output()
        .map_err(|e| format!("could not run {}: {e}", ptxas.display()))?;
    let text =
        String::from_utf8_lossy(&out.stderr).into_owned() + &String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        return Err(format!(
            "{} -arch={arch} failed on {}:\n{text}",
            ptxas.display(),
            ptx_file.display()
        ));
    }
    Ok(text)
}

/// What `ptxas --version` prints (its last line names the release), or
/// `None` if it does not run.
pub fn version(ptxas: &Path) -> Option<String> {
    let out = Command::new(ptxas).arg("--version").output().ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// Parses the `ptxas -v` report: one record per "Compiling entry function".
pub fn parse_report(text: &str) -> Vec<KernelResources> {
    let mut out: Vec<KernelResources> = Vec::new();
    let number_before = |line: &str, word: &str| -> Option<u32> {
        let i = line.find(word)?;
        line[..i].split_whitespace().last()?.parse().ok()
    };
    for line in text.lines() {
        if let Some(rest) = line.split("Compiling entry function '").nth(1) {
            let name = rest.split('\'').next().unwrap_or_default().to_string();
            out.push(KernelResources {
                entry: name,
                ..Default::default()
            });
            continue;
        }
        let Some(cur) = out.last_mut() else { continue };
        if line.contains("bytes stack frame") {
            cur.stack_frame_bytes = number_before(line, "bytes stack frame").unwrap_or(0);
            cur.spill_store_bytes = number_before(line, "bytes spill stores").unwrap_or(0);
            cur.spill_load_bytes = number_before(line, "bytes spill loads").unwrap_or(0);
        } else if line.contains(" registers") {
            cur.registers = number_before(line, "registers").unwrap_or(0);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_a_report() {
        let text = "ptxas info    : Compiling entry function 'k_a' for 'sm_90'\n\
ptxas info    : Function properties for k_a\n\
    8 bytes stack frame, 4 bytes spill stores, 12 bytes spill loads\n\
ptxas info    : Used 40 registers, used 1 barriers, 96 bytes cmem[0]\n\
ptxas info    : Compiling entry function 'k_b' for 'sm_90'\n\
ptxas info    : Function properties for k_b\n\
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n\
ptxas info    : Used 7 registers, used 0 barriers\n";
        let r = parse_report(text);
        assert_eq!(r.len(), 2);
        assert_eq!(
            r[0],
            KernelResources {
                entry: "k_a".into(),
                registers: 40,
                stack_frame_bytes: 8,
                spill_store_bytes: 4,
                spill_load_bytes: 12
            }
        );
        assert_eq!(r[1].registers, 7);
        assert_eq!(r[1].spill_load_bytes, 0);
    }
}
