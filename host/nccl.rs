//! NCCL, loaded at run time (cargo feature `nccl`): the comparison baseline of
//! the benchmarks and an opt-in fallback for [`crate::PeerGroup`].
//!
//! NCCL sums in its own order, so its results are *not* covered by the
//! determinism contract: it is used only when asked ([`NcclGroup`],
//! [`NcclRank`]) or when `Config::nccl_above` sets a size above which
//! `PeerGroup::allreduce_routed` may hand over.
//!
//! The library is found without any link or environment set up by hand, in
//! this order (see [`library_candidates`]):
//! 1. `P2P_ALLREDUCE_NCCL`: a path to `libnccl.so*`;
//! 2. `libnccl.so.2`, then `libnccl.so`, through the dynamic loader
//!    (`LD_LIBRARY_PATH`, the ldconfig cache);
//! 3. the `nvidia-nccl-cu13` / `nvidia-nccl-cu12` Python wheels
//!    (`site-packages/nvidia/nccl/lib/libnccl.so.2`) of the Python
//!    installations and virtual environment found on this machine.
//!
//! Only the handful of entry points used here are bound (a small, checked
//! layer like cudarc's `result` module), so no NCCL headers or build-time
//! NCCL are needed. NCCL's symmetric-memory entry points (`ncclMemAlloc`,
//! `ncclMemFree`, `ncclCommWindowRegister`, `ncclCommWindowDeregister`,
//! NCCL >= 2.27) are bound where the library has them: their absence is a
//! [`SymmetricUnavailable`] reason ([`symmetric_support`]), not an error of
//! the rest.

use crate::abi::Dtype;
use crate::error::{Error, Result};

use std::ffi::{c_char, c_int, c_void, CStr};
use std::path::PathBuf;
use std::sync::OnceLock;

type NcclResult = c_int;
type RawComm = *mut c_void;
/// `ncclWindow_t`: an opaque handle.
type RawWindow = *mut c_void;

/// `NCCL_WIN_COLL_SYMMETRIC`: the window may be used by NCCL's symmetric
/// kernels (every rank registers a buffer of the same size).
const NCCL_WIN_COLL_SYMMETRIC: c_int = 0x01;

/// The first NCCL version with symmetric windows (2.27.0).
pub const SYMMETRIC_MIN_VERSION: i32 = 22700;

/// NCCL's symmetric-memory entry points, where the library has them.
struct SymmetricApi {
    mem_alloc: unsafe extern "C" fn(*mut *mut c_void, usize) -> NcclResult,
    mem_free: unsafe extern "C" fn(*mut c_void) -> NcclResult,
    window_register:
        unsafe extern "C" fn(RawComm, *mut c_void, usize, *mut RawWindow, c_int) -> NcclResult,
    window_deregister: unsafe extern "C" fn(RawComm, RawWindow) -> NcclResult,
}

/// Why NCCL's symmetric kernels cannot be used here (`info` prints it;
/// `tune` and `bench` then leave the `nccl_symmetric` rows out).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SymmetricUnavailable {
    /// libnccl itself could not be loaded.
    NoNccl(String),
    /// The loaded NCCL predates symmetric windows (version code, e.g. 22603).
    OldNccl { version: i32 },
    /// The loaded NCCL reports a new enough version but lacks this entry point.
    MissingSymbol(&'static str),
}

impl std::fmt::Display for SymmetricUnavailable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SymmetricUnavailable::NoNccl(e) => write!(f, "no NCCL: {e}"),
            SymmetricUnavailable::OldNccl { version } => write!(
                f,
                "NCCL {} has no symmetric windows (they need NCCL >= 2.27: e.g. `pip install -U nvidia-nccl-cu12`, or P2P_ALLREDUCE_NCCL naming a newer libnccl.so.2)",
                version_string(*version)
            ),
            SymmetricUnavailable::MissingSymbol(s) => write!(
                f,
                "the loaded libnccl lacks {s} (symmetric windows need NCCL >= 2.27 built with them)"
            ),
        }
    }
}

/// A version code as `major.minor.patch` (22703 -> "2.27.3").
pub fn version_string(code: i32) -> String {
    format!("{}.{}.{}", code / 10000, code / 100 % 100, code % 100)
}

/// `ncclUniqueId`: 128 opaque bytes.
#[repr(C)]
#[derive(Clone, Copy)]
struct UniqueId {
    internal: [c_char; 128],
}

/// Bytes of an NCCL unique id (what ranks exchange to form a communicator).
pub const UNIQUE_ID_BYTES: usize = 128;

const NCCL_SUM: c_int = 0;

/// What one `ncclAllReduce` reduces: an `ncclDataType_t` and an
/// `ncclRedOp_t` (codes of nccl.h).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct NcclOp {
    pub data_type: c_int,
    pub op: c_int,
}

impl NcclOp {
    /// The sum of `dtype` elements (what the kernels' allreduce computes).
    pub(crate) fn sum(dtype: Dtype) -> Self {
        NcclOp {
            data_type: nccl_dtype(dtype),
            op: NCCL_SUM,
        }
    }
}

fn nccl_dtype(d: Dtype) -> c_int {
    match d {
        Dtype::F16 => 6,  // ncclFloat16
        Dtype::F32 => 7,  // ncclFloat32
        Dtype::Bf16 => 9, // ncclBfloat16
    }
}

/// The bound entry points of one loaded libnccl.
struct Api {
    _lib: libloading::Library,
    path: String,
    get_version: unsafe extern "C" fn(*mut c_int) -> NcclResult,
    get_unique_id: unsafe extern "C" fn(*mut UniqueId) -> NcclResult,
    comm_init_rank: unsafe extern "C" fn(*mut RawComm, c_int, UniqueId, c_int) -> NcclResult,
    comm_init_all: unsafe extern "C" fn(*mut RawComm, c_int, *const c_int) -> NcclResult,
    comm_destroy: unsafe extern "C" fn(RawComm) -> NcclResult,
    all_reduce: unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        c_int,
        c_int,
        RawComm,
        *mut c_void,
    ) -> NcclResult,
    group_start: unsafe extern "C" fn() -> NcclResult,
    group_end: unsafe extern "C" fn() -> NcclResult,
    error_string: unsafe extern "C" fn(NcclResult) -> *const c_char,
    /// The symmetric-memory entry points, or the first one missing.
    symmetric: std::result::Result<SymmetricApi, &'static str>,
}

/// Where libnccl is looked for, in order (paths or loader names).
pub fn library_candidates() -> Vec<String> {
    let mut v = Vec::new();
    if let Ok(p) = std::env::var("P2P_ALLREDUCE_NCCL") {
        if !p.is_empty() {
            v.push(p);
        }
    }
    v.push("libnccl.so.2".into());
    v.push("libnccl.so".into());
    for dir in site_package_dirs() {
        let p = dir.join("nvidia/nccl/lib/libnccl.so.2");
        if p.exists() {
            let p = p.to_string_lossy().into_owned();
            if !v.contains(&p) {
                v.push(p);
            }
        }
    }
    v
}

/// Python site-packages directories that may hold the NCCL wheels: the
/// active virtual environment, every Python installation on `PATH`
/// (`<prefix>/bin/python3` -> `<prefix>/lib`), the usual system prefixes
/// and the user's.
fn site_package_dirs() -> Vec<PathBuf> {
    let mut roots: Vec<PathBuf> = Vec::new();
    if let Ok(venv) = std::env::var("VIRTUAL_ENV") {
        roots.push(PathBuf::from(venv).join("lib"));
    }
    if let Some(path) = std::env::var_os("PATH") {
        for dir in std::env::split_paths(&path) {
            if dir.join("python3").exists() {
                if let Some(prefix) = dir.parent() {
                    roots.push(prefix.join("lib"));
                }
            }
        }
    }
    for r in ["/usr/local/lib", "/usr/lib", "/opt/conda/lib"] {
        roots.push(r.into());
    }
    if let Ok(home) = std::env::var("HOME") {
        roots.push(PathBuf::from(home).join(".local/lib"));
    }
    let mut out = Vec::new();
    for root in roots {
        let Ok(entries) = std::fs::read_dir(&root) else {
            continue;
        };
        let mut pythons: Vec<PathBuf> = entries
            .flatten()
            .map(|e| e.path())
            .filter(|p| {
                p.file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.starts_with("python3"))
            })
            .collect();
        pythons.sort();
        for py in pythons.into_iter().rev() {
            out.push(py.join("site-packages"));
            out.push(py.join("dist-packages"));
        }
    }
    out
}

fn api() -> Result<&'static Api> {
    static API: OnceLock<std::result::Result<Api, String>> = OnceLock::new();
    API.get_or_init(load)
        .as_ref()
        .map_err(|e| Error::Nccl(e.clone()))
}

fn load() -> std::result::Result<Api, String> {
    let candidates = library_candidates();
    let mut tried = Vec::new();
    for c in &candidates {
        // SAFETY: loading libnccl runs its initialisers, which only set up
        // NCCL's own state.
        match unsafe { libloading::Library::new(c) } {
            Ok(lib) => return bind(lib, c).map_err(|e| format!("{c}: {e}")),
            Err(e) => tried.push(format!("{c} ({e})")),
        }
    }
    Err(format!(
        "libnccl could not be loaded; tried: {}. Install NCCL (e.g. `pip install nvidia-nccl-cu12`) or set \
         P2P_ALLREDUCE_NCCL to the path of libnccl.so.2",
        tried.join("; ")
    ))
}

fn bind_symmetric(lib: &libloading::Library) -> std::result::Result<SymmetricApi, &'static str> {
    // SAFETY: each symbol is looked up by its NCCL name and given the
    // signature of nccl.h 2.27 (`ncclMemAlloc(void**, size_t)`,
    // `ncclMemFree(void*)`, `ncclCommWindowRegister(ncclComm_t, void*,
    // size_t, ncclWindow_t*, int)`, `ncclCommWindowDeregister(ncclComm_t,
    // ncclWindow_t)`); the function pointers are copied out while `lib`
    // is alive and stay valid as long as the `Api` that owns `lib`.
    unsafe {
        Ok(SymmetricApi {
            mem_alloc: *lib.get(b"ncclMemAlloc\0").map_err(|_| "ncclMemAlloc")?,
            mem_free: *lib.get(b"ncclMemFree\0").map_err(|_| "ncclMemFree")?,
            window_register: *lib
                .get(b"ncclCommWindowRegister\0")
                .map_err(|_| "ncclCommWindowRegister")?,
            window_deregister: *lib
                .get(b"ncclCommWindowDeregister\0")
                .map_err(|_| "ncclCommWindowDeregister")?,
        })
    }
}

fn bind(lib: libloading::Library, path: &str) -> std::result::Result<Api, libloading::Error> {
    let symmetric = bind_symmetric(&lib);
    // SAFETY: each symbol is looked up by its NCCL name and given the
    // signature of nccl.h (NCCL 2.x ABI, stable since 2.0).
    unsafe {
        Ok(Api {
            symmetric,
            get_version: *lib.get(b"ncclGetVersion\0")?,
            get_unique_id: *lib.get(b"ncclGetUniqueId\0")?,
            comm_init_rank: *lib.get(b"ncclCommInitRank\0")?,
            comm_init_all: *lib.get(b"ncclCommInitAll\0")?,
            comm_destroy: *lib.get(b"ncclCommDestroy\0")?,
            all_reduce: *lib.get(b"ncclAllReduce\0")?,
            group_start: *lib.get(b"ncclGroupStart\0")?,
            group_end: *lib.get(b"ncclGroupEnd\0")?,
            error_string: *lib.get(b"ncclGetErrorString\0")?,
            path: path.to_string(),
            _lib: lib,
        })
    }
}

fn check(api: &Api, r: NcclResult, during: &str) -> Result<()> {
    if r == 0 {
        return Ok(());
    }
    // SAFETY: ncclGetErrorString returns a static NUL-terminated string.
    let msg = unsafe { CStr::from_ptr((api.error_string)(r)) }.to_string_lossy();
    Err(Error::Nccl(format!("{during}: {msg} (code {r})")))
}

/// Whether libnccl can be loaded.
pub fn nccl_present() -> bool {
    api().is_ok()
}

/// The loaded library: its path and NCCL's version code (e.g. 22809).
pub fn library() -> Result<(String, i32)> {
    let a = api()?;
    let mut v: c_int = 0;
    // SAFETY: valid out-pointer.
    check(a, unsafe { (a.get_version)(&mut v) }, "ncclGetVersion")?;
    Ok((a.path.clone(), v))
}

/// Whether NCCL's symmetric kernels can be used: `Ok` with NCCL >= 2.27
/// and its four symmetric-memory entry points, else why not.
pub fn symmetric_support() -> std::result::Result<(), SymmetricUnavailable> {
    symmetric_api().map(|_| ())
}

fn symmetric_api() -> std::result::Result<&'static SymmetricApi, SymmetricUnavailable> {
    let a = api().map_err(|e| SymmetricUnavailable::NoNccl(e.to_string()))?;
    let (_, version) = library().map_err(|e| SymmetricUnavailable::NoNccl(e.to_string()))?;
    if version < SYMMETRIC_MIN_VERSION {
        return Err(SymmetricUnavailable::OldNccl { version });
    }
    a.symmetric
        .as_ref()
        .map_err(|s| SymmetricUnavailable::MissingSymbol(s))
}

/// A new NCCL unique id (on one rank; the others receive its bytes).
pub fn unique_id() -> Result<[u8; UNIQUE_ID_BYTES]> {
    let a = api()?;
    let mut id = UniqueId { internal: [0; 128] };
    // SAFETY: valid out-pointer.
    check(a, unsafe { (a.get_unique_id)(&mut id) }, "ncclGetUniqueId")?;
    Ok(id.internal.map(|c| c as u8))
}

mod comm;
pub use comm::{NcclGroup, NcclRank, SymmetricBuffers};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn candidates_start_with_the_override_then_the_loader_names() {
        let c = library_candidates();
        let first_loader = c
            .iter()
            .position(|x| x == "libnccl.so.2")
            .expect("loader name");
        assert_eq!(c[first_loader + 1], "libnccl.so");
        assert!(first_loader <= 1);
        for p in &c[first_loader + 2..] {
            assert!(p.ends_with("nvidia/nccl/lib/libnccl.so.2"), "{p}");
        }
    }

    #[test]
    fn symmetric_reasons_say_what_to_do() {
        assert_eq!(version_string(22703), "2.27.3");
        let old = SymmetricUnavailable::OldNccl { version: 22603 }.to_string();
        assert!(old.contains("2.26.3") && old.contains(">= 2.27"), "{old}");
        let missing = SymmetricUnavailable::MissingSymbol("ncclMemAlloc").to_string();
        assert!(missing.contains("ncclMemAlloc"), "{missing}");
        // Here (no NCCL, or whichever is installed) the answer is a value,
        // never a panic, and agrees with the version the library reports.
        match (symmetric_support(), library()) {
            (Ok(()), Ok((_, v))) => assert!(v >= SYMMETRIC_MIN_VERSION, "{v}"),
            (Err(SymmetricUnavailable::OldNccl { version }), Ok((_, v))) => {
                assert_eq!(version, v);
                assert!(v < SYMMETRIC_MIN_VERSION);
            }
            (Err(SymmetricUnavailable::MissingSymbol(_)), Ok(_)) => {}
            (Err(SymmetricUnavailable::NoNccl(_)), Err(_)) => {}
            (got, lib) => panic!("symmetric_support {got:?} disagrees with library {lib:?}"),
        }
    }

    #[test]
    fn dtype_codes_match_nccl_h() {
        assert_eq!(nccl_dtype(Dtype::F16), 6);
        assert_eq!(nccl_dtype(Dtype::F32), 7);
        assert_eq!(nccl_dtype(Dtype::Bf16), 9);
    }
}
