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
//! NCCL are needed.

use crate::abi::Dtype;
use crate::element::DeviceElement;
use crate::error::{Error, Result};
use cudarc::driver::{CudaContext, CudaStream, DevicePtr, DevicePtrMut};
use std::ffi::{c_char, c_int, c_void, CStr};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, OnceLock};

type NcclResult = c_int;
type RawComm = *mut c_void;

/// `ncclUniqueId`: 128 opaque bytes.
#[repr(C)]
#[derive(Clone, Copy)]
struct UniqueId {
    internal: [c_char; 128],
}

/// Bytes of an NCCL unique id (what ranks exchange to form a communicator).
pub const UNIQUE_ID_BYTES: usize = 128;

const NCCL_SUM: c_int = 0;

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

fn bind(lib: libloading::Library, path: &str) -> std::result::Result<Api, libloading::Error> {
    // SAFETY: each symbol is looked up by its NCCL name and given the
    // signature of nccl.h (NCCL 2.x ABI, stable since 2.0).
    unsafe {
        Ok(Api {
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

/// A new NCCL unique id (on one rank; the others receive its bytes).
pub fn unique_id() -> Result<[u8; UNIQUE_ID_BYTES]> {
    let a = api()?;
    let mut id = UniqueId { internal: [0; 128] };
    // SAFETY: valid out-pointer.
    check(a, unsafe { (a.get_unique_id)(&mut id) }, "ncclGetUniqueId")?;
    Ok(id.internal.map(|c| c as u8))
}

/// One communicator; destroyed on drop with its context current.
struct Comm {
    ctx: Arc<CudaContext>,
    raw: RawComm,
}

// SAFETY: an NCCL communicator may be used from any thread; the owners below
// serialise their calls (one at a time per communicator) with a Mutex.
unsafe impl Send for Comm {}
// SAFETY: as above.
unsafe impl Sync for Comm {}

impl Drop for Comm {
    fn drop(&mut self) {
        if let (Ok(a), Ok(())) = (api(), self.ctx.bind_to_thread()) {
            // SAFETY: `raw` came from ncclCommInit* and is destroyed once.
            let _ = unsafe { (a.comm_destroy)(self.raw) };
        }
    }
}

impl Comm {
    /// Enqueues `ncclAllReduce(sum)` of `count` elements on `stream`.
    ///
    /// # Safety
    /// `input` and `output` must be valid for `count` elements of `dtype` on
    /// this communicator's device until the work on `stream` completes.
    unsafe fn all_reduce(
        &self,
        a: &Api,
        stream: &CudaStream,
        dtype: Dtype,
        count: usize,
        input: u64,
        output: u64,
    ) -> Result<()> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| Error::Nccl(format!("cuCtxSetCurrent: {e}")))?;
        // SAFETY: forwarded from the caller; the stream handle is live.
        let r = unsafe {
            (a.all_reduce)(
                input as *const c_void,
                output as *mut c_void,
                count,
                nccl_dtype(dtype),
                NCCL_SUM,
                self.raw,
                stream.cu_stream() as *mut c_void,
            )
        };
        check(a, r, "ncclAllReduce")
    }
}

fn need_driver() -> Result<()> {
    if !crate::driver::driver_present() {
        return Err(Error::NoDriver);
    }
    Ok(())
}

/// One NCCL communicator per rank, all driven from this process (one rank
/// per GPU: NCCL refuses two ranks on one device).
pub struct NcclGroup {
    comms: Vec<Comm>,
    lock: Mutex<()>,
}

impl std::fmt::Debug for NcclGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclGroup")
            .field("world", &self.comms.len())
            .finish()
    }
}

impl NcclGroup {
    /// `streams[r]` is rank r's stream; each must be on a distinct GPU.
    pub fn new(streams: &[Arc<CudaStream>]) -> Result<Self> {
        need_driver()?;
        let a = api()?;
        let devs: Vec<c_int> = streams
            .iter()
            .map(|s| s.context().ordinal() as c_int)
            .collect();
        for (i, d) in devs.iter().enumerate() {
            if devs[..i].contains(d) {
                return Err(Error::Nccl(format!(
                    "ranks {} and {i} are both on GPU {d}: NCCL needs one GPU per rank",
                    devs.iter().position(|x| x == d).unwrap_or(0)
                )));
            }
        }
        let mut raw: Vec<RawComm> = vec![std::ptr::null_mut(); devs.len()];
        // SAFETY: `raw` has room for one communicator per device in `devs`.
        let r = unsafe { (a.comm_init_all)(raw.as_mut_ptr(), devs.len() as c_int, devs.as_ptr()) };
        check(a, r, "ncclCommInitAll")?;
        let comms = raw
            .into_iter()
            .zip(streams)
            .map(|(raw, s)| Comm {
                ctx: s.context().clone(),
                raw,
            })
            .collect();
        Ok(NcclGroup {
            comms,
            lock: Mutex::new(()),
        })
    }

    pub fn world(&self) -> usize {
        self.comms.len()
    }

    /// Sum-allreduce of `inputs[r]` into `outputs[r]` on `streams[r]`.
    pub fn allreduce<T, I, O>(
        &self,
        streams: &[Arc<CudaStream>],
        inputs: &[&I],
        outputs: &mut [O],
    ) -> Result<()>
    where
        T: DeviceElement,
        I: DevicePtr<T>,
        O: DevicePtrMut<T>,
    {
        let w = self.world();
        for (what, got) in [
            ("streams", streams.len()),
            ("inputs", inputs.len()),
            ("outputs", outputs.len()),
        ] {
            if got != w {
                return Err(Error::RankCount {
                    what,
                    got,
                    world: w,
                });
            }
        }
        let count = inputs[0].len();
        for r in 0..w {
            if inputs[r].len() != count {
                return Err(Error::RankMismatch {
                    rank: r,
                    dtype: T::DTYPE,
                    count: inputs[r].len(),
                    dtype0: T::DTYPE,
                    count0: count,
                });
            }
            if outputs[r].len() < count {
                return Err(Error::BufferTooSmall {
                    what: "output",
                    rank: r,
                    len: outputs[r].len(),
                    need: count,
                });
            }
        }
        let mut ins = Vec::with_capacity(w);
        let mut outs = Vec::with_capacity(w);
        for r in 0..w {
            ins.push(inputs[r].device_ptr(&streams[r]));
        }
        for (r, o) in outputs.iter_mut().enumerate() {
            outs.push(o.device_ptr_mut(&streams[r]));
        }
        let i: Vec<u64> = ins.iter().map(|p| p.0).collect();
        let o: Vec<u64> = outs.iter().map(|p| p.0).collect();
        // SAFETY: pointers from live slices of >= count elements, guarded
        // until the work is enqueued (and recorded on each stream).
        unsafe { self.allreduce_raw(streams, T::DTYPE, count, &i, &o) }
    }

    /// [`NcclGroup::allreduce`] on raw pointers (in place allowed). Works
    /// inside CUDA-graph capture of every rank's stream.
    ///
    /// # Safety
    /// `inputs[r]`/`outputs[r]` valid for `count` elements of `dtype` on
    /// rank r's device until the work on `streams[r]` completes.
    pub unsafe fn allreduce_raw(
        &self,
        streams: &[Arc<CudaStream>],
        dtype: Dtype,
        count: usize,
        inputs: &[u64],
        outputs: &[u64],
    ) -> Result<()> {
        let a = api()?;
        let w = self.world();
        if streams.len() != w || inputs.len() != w || outputs.len() != w {
            return Err(Error::RankCount {
                what: "streams/inputs/outputs",
                got: streams.len().min(inputs.len()).min(outputs.len()),
                world: w,
            });
        }
        let _one_at_a_time = self.lock.lock().unwrap_or_else(|p| p.into_inner());
        // SAFETY: plain call; every ncclGroupStart is matched below.
        check(a, unsafe { (a.group_start)() }, "ncclGroupStart")?;
        let mut first = Ok(());
        for (r, comm) in self.comms.iter().enumerate() {
            // SAFETY: forwarded from the caller.
            let res =
                unsafe { comm.all_reduce(a, &streams[r], dtype, count, inputs[r], outputs[r]) };
            if first.is_ok() {
                first = res;
            }
        }
        // The group must be closed even after an error.
        // SAFETY: matches the ncclGroupStart above.
        check(a, unsafe { (a.group_end)() }, "ncclGroupEnd")?;
        first
    }
}

/// This process's rank of an NCCL communicator spanning several processes
/// (one GPU each), formed through an [`crate::Exchange`].
pub struct NcclRank {
    comm: Comm,
    rank: usize,
    world: usize,
    lock: Mutex<()>,
}

impl std::fmt::Debug for NcclRank {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclRank")
            .field("rank", &self.rank)
            .field("world", &self.world)
            .finish()
    }
}

impl NcclRank {
    /// Joins the communicator of `exchange.world()` ranks as
    /// `exchange.rank()` on `ctx`'s GPU. Rank 0 creates the unique id; every
    /// rank calls this at the same point.
    pub fn new(ctx: &Arc<CudaContext>, exchange: &dyn crate::Exchange) -> Result<Self> {
        need_driver()?;
        let a = api()?;
        let (rank, world) = (exchange.rank(), exchange.world());
        let mine = if rank == 0 {
            unique_id()?.to_vec()
        } else {
            Vec::new()
        };
        let all = exchange.all_gather(&mine)?;
        let id_bytes = all
            .first()
            .filter(|b| b.len() == UNIQUE_ID_BYTES)
            .ok_or_else(|| Error::Rendezvous("rank 0 did not send an NCCL unique id".into()))?;
        let mut id = UniqueId { internal: [0; 128] };
        for (d, b) in id.internal.iter_mut().zip(id_bytes) {
            *d = *b as c_char;
        }
        ctx.bind_to_thread()
            .map_err(|e| Error::Nccl(format!("cuCtxSetCurrent: {e}")))?;
        let mut raw: RawComm = std::ptr::null_mut();
        // SAFETY: valid out-pointer; the id came from rank 0's ncclGetUniqueId.
        let r = unsafe { (a.comm_init_rank)(&mut raw, world as c_int, id, rank as c_int) };
        check(a, r, "ncclCommInitRank")?;
        Ok(NcclRank {
            comm: Comm {
                ctx: ctx.clone(),
                raw,
            },
            rank,
            world,
            lock: Mutex::new(()),
        })
    }

    pub fn rank(&self) -> usize {
        self.rank
    }
    pub fn world(&self) -> usize {
        self.world
    }

    /// Enqueues this rank's sum-allreduce of `count` elements on `stream`.
    ///
    /// # Safety
    /// `input`/`output` valid for `count` elements of `dtype` on this rank's
    /// device until the work on `stream` completes.
    pub unsafe fn allreduce_raw(
        &self,
        stream: &CudaStream,
        dtype: Dtype,
        count: usize,
        input: u64,
        output: u64,
    ) -> Result<()> {
        let a = api()?;
        let _one_at_a_time = self.lock.lock().unwrap_or_else(|p| p.into_inner());
        // SAFETY: forwarded from the caller.
        unsafe { self.comm.all_reduce(a, stream, dtype, count, input, output) }
    }
}

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
    fn dtype_codes_match_nccl_h() {
        assert_eq!(nccl_dtype(Dtype::F16), 6);
        assert_eq!(nccl_dtype(Dtype::F32), 7);
        assert_eq!(nccl_dtype(Dtype::Bf16), 9);
    }
}
