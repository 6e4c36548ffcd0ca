//! Thin, checked wrappers over the CUDA driver (through cudarc's dynamic
//! loading): driver presence, device facts, owned allocations, copies,
//! launches, peer access, CUDA IPC, and the loaded kernel module. Nothing
//! here knows about allreduce semantics.
//!
//! Invariant: every driver call made here first makes the context that owns
//! the memory, stream or module current on the calling thread
//! (`bind_to_thread`). With several GPUs in one process, a call issued while
//! another device's context is current fails (`CUDA_ERROR_INVALID_VALUE` /
//! `INVALID_CONTEXT`) or, worse, acts on the wrong device; so no code
//! outside this module makes raw driver calls.

use crate::error::{Context as _, Error, Result};
use crate::ptx::{self, PtxModule};
use cudarc::driver::{result, sys, CudaContext, CudaStream};
use std::ffi::CString;
use std::sync::Arc;

mod ipc;
mod kernels;
mod mailbox;

pub use ipc::{address_range, ipc_export, IpcMapping, IPC_HANDLE_BYTES};
pub use kernels::Kernels;
pub use mailbox::{HostMailbox, HostMapped};

/// What this process holds through the driver layer right now: device
/// allocations ([`DeviceAlloc`]), peers' allocations mapped through CUDA
/// IPC ([`IpcMapping`]), pinned host words and buffers ([`HostMailbox`],
/// [`HostMapped`]), and events (the one [`order_after`] records lives for
/// the call). For leak checks (`p2p-allreduce soak`, the GPU suite): a
/// group's drop must bring every count back to where it was before it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Handles {
    pub device_allocs: i64,
    pub ipc_mappings: i64,
    pub host_pinned: i64,
    pub events: i64,
}

pub(crate) mod counts {
    use std::sync::atomic::{AtomicI64, Ordering};
    pub static DEVICE_ALLOCS: AtomicI64 = AtomicI64::new(0);
    pub static IPC_MAPPINGS: AtomicI64 = AtomicI64::new(0);
    pub static HOST_PINNED: AtomicI64 = AtomicI64::new(0);
    pub static EVENTS: AtomicI64 = AtomicI64::new(0);
    pub fn up(c: &AtomicI64) {
        c.fetch_add(1, Ordering::Relaxed);
    }
    pub fn down(c: &AtomicI64) {
        c.fetch_sub(1, Ordering::Relaxed);
    }
}

/// The live counts of [`Handles`].
pub fn live_handles() -> Handles {
    use std::sync::atomic::Ordering::Relaxed;
    Handles {
        device_allocs: counts::DEVICE_ALLOCS.load(Relaxed),
        ipc_mappings: counts::IPC_MAPPINGS.load(Relaxed),
        host_pinned: counts::HOST_PINNED.load(Relaxed),
        events: counts::EVENTS.load(Relaxed),
    }
}

/// Free and total bytes of `ctx`'s device (`cuMemGetInfo`).
pub fn mem_info(ctx: &Arc<CudaContext>) -> Result<(usize, usize)> {
    ctx.bind_to_thread().during("cuCtxSetCurrent")?;
    result::mem_get_info().during("cuMemGetInfo")
}

/// The names libcuda is opened by (cudarc's `dynamic-loading` tries these
/// among others; a binary linked to libcuda has `libcuda.so.1` loaded).
const DRIVER_LIBRARIES: &[&str] = &["libcuda.so.1", "libcuda.so", "nvcuda.dll"];

/// Whether libcuda can be loaded. cudarc panics on first use without it, so
/// every entry point asks this first. Asked of the dynamic loader here, not
/// of cudarc (whose `is_culib_present` exists only under its
/// `dynamic-loading` mode): under every linking mode an embedding build
/// may pick (see Cargo.toml), the answer is the same. Cached: the driver
/// does not come or go while a process runs.
pub fn driver_present() -> bool {
    static PRESENT: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *PRESENT.get_or_init(|| {
        DRIVER_LIBRARIES.iter().any(|name| {
            // SAFETY: opening libcuda runs its initialisers only (no CUDA
            // call is made); the handle is closed again at once.
            unsafe { libloading::Library::new(*name) }.is_ok()
        })
    })
}

/// Number of CUDA devices, or `Error::NoDriver`.
pub fn device_count() -> Result<usize> {
    if !driver_present() {
        return Err(Error::NoDriver);
    }
    let n = CudaContext::device_count().during("cuDeviceGetCount")?;
    Ok(n.max(0) as usize)
}

/// The CUDA version the driver supports, as `(major, minor)`.
pub fn driver_version() -> Result<(u32, u32)> {
    if !driver_present() {
        return Err(Error::NoDriver);
    }
    let mut v = 0i32;
    // SAFETY: plain query with a valid out-pointer; libcuda is present.
    unsafe { sys::cuDriverGetVersion(&mut v) }
        .result()
        .during("cuDriverGetVersion")?;
    Ok(((v / 1000) as u32, ((v % 1000) / 10) as u32))
}

/// Opens (retains the primary context of) device `ordinal`.
pub fn open_device(ordinal: usize) -> Result<Arc<CudaContext>> {
    if !driver_present() {
        return Err(Error::NoDriver);
    }
    CudaContext::new(ordinal).during("opening the device (cuDevicePrimaryCtxRetain)")
}

/// Facts about one device.
#[derive(Clone, Debug)]
pub struct DeviceInfo {
    pub ordinal: usize,
    pub name: String,
    pub compute_capability: (u32, u32),
    pub multiprocessors: u32,
    pub total_mem: usize,
}

/// The device's compute capability, e.g. `(9, 0)`.
pub fn compute_capability(ctx: &Arc<CudaContext>) -> Result<(u32, u32)> {
    let (major, minor) = ctx
        .compute_capability()
        .during("cuDeviceGetAttribute(compute capability)")?;
    Ok((major as u32, minor as u32))
}

pub fn device_info(ctx: &Arc<CudaContext>) -> Result<DeviceInfo> {
    let compute_capability = compute_capability(ctx)?;
    let sms = ctx
        .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
        .during("cuDeviceGetAttribute(multiprocessors)")?;
    Ok(DeviceInfo {
        ordinal: ctx.ordinal(),
        name: ctx.name().during("cuDeviceGetName")?,
        compute_capability,
        multiprocessors: sms as u32,
        total_mem: ctx.total_mem().during("cuDeviceTotalMem")?,
    })
}

/// The embedded PTX this device would run.
pub fn module_for_device(ctx: &Arc<CudaContext>) -> Result<&'static PtxModule> {
    let (major, minor) = compute_capability(ctx)?;
    ptx::module_for((major, minor)).ok_or_else(|| Error::NoPtxForDevice {
        major,
        minor,
        built: ptx::built_archs(),
    })
}

mod sealed {
    pub trait Sealed {}
}

/// Types whose every bit pattern is a valid value (no padding read as
/// data, no invalid states such as `bool` or `char` have): the only types
/// [`DeviceAlloc::read`] and [`DeviceAlloc::write`] move. Sealed: the list
/// below is the whole set.
///
/// # Safety
/// Implementors must be `Copy`, contain no pointers the host would follow,
/// and accept any bit pattern.
pub unsafe trait PlainData: Copy + sealed::Sealed {
    /// The all-zero value.
    fn zeroed() -> Self {
        // SAFETY: every bit pattern, all zeros included, is a valid value
        // of a PlainData type (the trait's contract).
        unsafe { std::mem::zeroed() }
    }
}

macro_rules! plain_data {
    ($($t:ty),*) => {$(
        impl sealed::Sealed for $t {}
        // SAFETY: integers, IEEE floats and the repr(C) ABI records (all
        // fields u32/u64, padding explicit) accept any bit pattern.
        unsafe impl PlainData for $t {}
    )*};
}
plain_data!(
    u8,
    u16,
    u32,
    u64,
    f32,
    half::f16,
    half::bf16,
    crate::abi::RankTable,
    crate::abi::ErrorRecord,
    crate::abi::Signal
);

/// Device memory from plain `cuMemAlloc` (so it can be exported as a CUDA
/// IPC handle), zeroed at creation, freed on drop.
pub struct DeviceAlloc {
    ctx: Arc<CudaContext>,
    ptr: sys::CUdeviceptr,
    bytes: usize,
}

impl DeviceAlloc {
    pub fn zeroed(ctx: &Arc<CudaContext>, bytes: usize) -> Result<Self> {
        ctx.bind_to_thread().during("cuCtxSetCurrent")?;
        // SAFETY: the context is current; a zero-size request is rounded up
        // so the pointer is always a real allocation.
        let ptr = unsafe { result::malloc_sync(bytes.max(256)) }.during("cuMemAlloc")?;
        let a = DeviceAlloc {
            ctx: ctx.clone(),
            ptr,
            bytes,
        };
        counts::up(&counts::DEVICE_ALLOCS);
        // SAFETY: `ptr` is a fresh allocation of at least `bytes` bytes.
        unsafe { result::memset_d8_sync(ptr, 0, bytes.max(256)) }.during("cuMemsetD8")?;
        Ok(a)
    }
    /// A new allocation holding exactly `value` (a table, a record).
    pub fn from_value<T: PlainData>(ctx: &Arc<CudaContext>, value: &T) -> Result<Self> {
        let a = Self::zeroed(ctx, std::mem::size_of::<T>())?;
        a.write(std::slice::from_ref(value))?;
        Ok(a)
    }
    pub fn ptr(&self) -> u64 {
        self.ptr
    }
    pub fn bytes(&self) -> usize {
        self.bytes
    }
    /// Zeroes the whole allocation, finished before it returns (the memset
    /// runs on the null stream; the context is synchronized after it, so
    /// no later work on any stream can see the old bytes).
    pub fn clear(&self) -> Result<()> {
        self.ctx.bind_to_thread().during("cuCtxSetCurrent")?;
        // SAFETY: the allocation holds at least `bytes.max(256)` bytes.
        unsafe { result::memset_d8_sync(self.ptr, 0, self.bytes.max(256)) }.during("cuMemsetD8")?;
        self.ctx.synchronize().during("cuCtxSynchronize")
    }
    /// Copies `src` into the start of the allocation (synchronous: the
    /// bytes are in device memory when it returns, for work on any stream).
    pub fn write<T: PlainData>(&self, src: &[T]) -> Result<()> {
        assert!(
            std::mem::size_of_val(src) <= self.bytes.max(256),
            "write past the end of a DeviceAlloc"
        );
        self.ctx.bind_to_thread().during("cuCtxSetCurrent")?;
        // SAFETY: bounds checked above; T is plain data (PlainData).
        unsafe { result::memcpy_htod_sync(self.ptr, src) }.during("cuMemcpyHtoD")?;
        // cuMemcpyHtoD from pageable memory may return once the bytes are
        // staged, before their DMA lands; a kernel on a non-blocking stream
        // (or a peer process reading this buffer) could then see the old
        // bytes (the GPU suite's fault matrix saw a poisoned element).
        self.ctx.synchronize().during("cuCtxSynchronize")
    }
    /// Reads `dst` from byte `offset` of the allocation (synchronous).
    pub fn read_at<T: PlainData>(&self, offset: usize, dst: &mut [T]) -> Result<()> {
        assert!(
            offset + std::mem::size_of_val(dst) <= self.bytes.max(256),
            "read past the end of a DeviceAlloc"
        );
        self.ctx.bind_to_thread().during("cuCtxSetCurrent")?;
        // SAFETY: bounds checked above; every bit pattern is a valid T (PlainData).
        unsafe { result::memcpy_dtoh_sync(dst, self.ptr + offset as u64) }.during("cuMemcpyDtoH")
    }
    /// Reads the start of the allocation into `dst` (synchronous).
    pub fn read<T: PlainData>(&self, dst: &mut [T]) -> Result<()> {
        self.read_at(0, dst)
    }
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }
}

/// Drops cannot return errors: a failed release is recorded in the
/// context (cudarc's deferred error) and reported by the next `check()`.
fn record_drop_error(
    ctx: &Arc<CudaContext>,
    r: std::result::Result<(), cudarc::driver::DriverError>,
) {
    ctx.record_err(r);
}

impl Drop for DeviceAlloc {
    fn drop(&mut self) {
        let r = self.ctx.bind_to_thread().and_then(|()| {
            // SAFETY: `ptr` came from cuMemAlloc and is freed exactly once.
            unsafe { result::free_sync(self.ptr) }
        });
        counts::down(&counts::DEVICE_ALLOCS);
        record_drop_error(&self.ctx, r);
    }
}

/// Copies `bytes` bytes from device address `src` to `dst`, ordered on
/// `stream`, with the stream's context current (the addresses may live on
/// any device that context can reach).
///
/// # Safety
/// Both ranges must be live device memory of at least `bytes` bytes until
/// the copy has run, and must not overlap.
pub unsafe fn copy_dtod_async(stream: &CudaStream, dst: u64, src: u64, bytes: usize) -> Result<()> {
    if bytes == 0 {
        return Ok(());
    }
    stream
        .context()
        .bind_to_thread()
        .during("cuCtxSetCurrent")?;
    // SAFETY: forwarded from the caller; the stream's context is current.
    unsafe { result::memcpy_dtod_async(dst, src, bytes, stream.cu_stream()) }
        .during("cuMemcpyDtoDAsync")
}

/// Lets `from`'s kernels access memory of `to`'s device. Enabling a pair
/// twice is not an error.
pub fn enable_peer_access(from: &Arc<CudaContext>, to: &Arc<CudaContext>) -> Result<()> {
    from.bind_to_thread().during("cuCtxSetCurrent")?;
    // SAFETY: both contexts are live (held by the Arcs).
    let r = unsafe { sys::cuCtxEnablePeerAccess(to.cu_ctx(), 0) };
    if r == sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED {
        return Ok(());
    }
    r.result().during("cuCtxEnablePeerAccess")
}

/// Copies `src` to device address `dst` (synchronous), with `ctx` current.
///
/// # Safety
/// `dst` must be live device memory of `ctx` with room for `src`.
pub unsafe fn write_at<T: Copy>(ctx: &Arc<CudaContext>, dst: u64, src: &[T]) -> Result<()> {
    ctx.bind_to_thread().during("cuCtxSetCurrent")?;
    // SAFETY: forwarded from the caller.
    unsafe { result::memcpy_htod_sync(dst, src) }.during("cuMemcpyHtoD")
}

/// The PCI bus id of `ctx`'s device (`domain:bus:device.function`).
pub fn pci_bus_id(ctx: &Arc<CudaContext>) -> Result<String> {
    let mut buf = [0 as std::ffi::c_char; 32];
    // SAFETY: the buffer is writable for its whole length.
    unsafe { sys::cuDeviceGetPCIBusId(buf.as_mut_ptr(), buf.len() as i32, ctx.cu_device()) }
        .result()
        .during("cuDeviceGetPCIBusId")?;
    // SAFETY: the driver wrote a NUL-terminated string into `buf`.
    let s = unsafe { std::ffi::CStr::from_ptr(buf.as_ptr()) };
    Ok(s.to_string_lossy().into_owned())
}

/// The device whose PCI bus id is `bus_id`, if this process sees it.
pub fn device_by_pci_bus_id(bus_id: &str) -> Option<sys::CUdevice> {
    let c = CString::new(bus_id).ok()?;
    let mut dev: sys::CUdevice = 0;
    // SAFETY: `c` is NUL-terminated; `dev` is a valid out-pointer.
    let r = unsafe { sys::cuDeviceGetByPCIBusId(&mut dev, c.as_ptr()) };
    (r == sys::CUresult::CUDA_SUCCESS).then_some(dev)
}

/// Whether `a`'s device can access `b`'s memory as a peer
/// (`cuDeviceCanAccessPeer`).
pub fn can_access_peer(a: sys::CUdevice, b: sys::CUdevice) -> Result<bool> {
    let mut can = 0i32;
    // SAFETY: plain query with device handles from the driver and a valid out-pointer.
    unsafe { sys::cuDeviceCanAccessPeer(&mut can, a, b) }
        .result()
        .during("cuDeviceCanAccessPeer")?;
    Ok(can != 0)
}

/// Whether `a` and `b` support native atomics over their P2P link
/// (`CU_DEVICE_P2P_ATTRIBUTE_NATIVE_ATOMIC_SUPPORTED`).
pub fn p2p_native_atomics(a: sys::CUdevice, b: sys::CUdevice) -> Result<bool> {
    let mut v = 0i32;
    // SAFETY: plain query with device handles from the driver and a valid out-pointer.
    unsafe {
        sys::cuDeviceGetP2PAttribute(
            &mut v,
            sys::CUdevice_P2PAttribute::CU_DEVICE_P2P_ATTRIBUTE_NATIVE_ATOMIC_SUPPORTED,
            a,
            b,
        )
    }
    .result()
    .during("cuDeviceGetP2PAttribute")?;
    Ok(v != 0)
}

/// Whether `stream` is capturing a CUDA graph.
pub fn is_capturing(stream: &CudaStream) -> Result<bool> {
    let st = capture_status(stream)?;
    Ok(st != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
}

/// `stream`'s capture status, leaving the context's deferred error (cudarc
/// reports it from every call that binds the context through
/// `bind_to_thread`, `CudaStream::capture_status` too) where it is.
fn capture_status(stream: &CudaStream) -> Result<sys::CUstreamCaptureStatus> {
    // SAFETY: the context is live (the stream holds it); making it current
    // on this thread is what `bind_to_thread` does, without its check.
    unsafe { result::ctx::set_current(stream.context().cu_ctx()) }.during("cuCtxSetCurrent")?;
    // SAFETY: `stream` is a live stream of the current context; the call
    // only reads its capture status.
    unsafe { result::stream::is_capturing(stream.cu_stream()) }.during("cuStreamIsCapturing")
}

/// For a stream whose context has cudarc's event tracking on: whether its
/// graph capture has been invalidated (a refused operation on the
/// capturing stream, e.g. cudarc waiting for an event recorded before the
/// capture), with the deferred error that says why (taken: it is reported
/// with this). Where the capture is still active and the only deferred
/// error is such a refused wait (`CUDA_ERROR_STREAM_CAPTURE_ISOLATION`,
/// which then had no effect), that error is dropped: the capture goes on.
/// Any other deferred error is left for `check()` to report.
pub fn capture_invalidated(stream: &CudaStream) -> Result<Option<String>> {
    let ctx = stream.context();
    // Taken first: cudarc reports a deferred error from every call that
    // binds the context (`capture_status` too), so the refused wait would
    // come back as that call's error instead of being judged here.
    let deferred = ctx.check_err().err();
    let st = capture_status(stream)?;
    match st {
        sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_INVALIDATED => {
            Ok(Some(match deferred {
                Some(e) => format!("the refused call: {e}"),
                None => "no deferred error recorded".into(),
            }))
        }
        sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_ACTIVE => {
            if let Some(e) = deferred {
                if e.0 != sys::CUresult::CUDA_ERROR_STREAM_CAPTURE_ISOLATION {
                    ctx.record_err::<()>(Err(e));
                }
            }
            Ok(None)
        }
        _ => {
            if let Some(e) = deferred {
                ctx.record_err::<()>(Err(e));
            }
            Ok(None)
        }
    }
}

/// Makes future work on `next` wait for the work already on `prev` (an
/// event recorded on `prev`, waited for on `next`). Both must belong to one
/// context. Refused while either stream captures a graph, where such a
/// dependency cannot be expressed.
pub fn order_after(prev: &Arc<CudaStream>, next: &Arc<CudaStream>) -> Result<()> {
    if is_capturing(prev)? || is_capturing(next)? {
        return Err(Error::StreamSwitchInCapture);
    }
    counts::up(&counts::EVENTS);
    let r = prev
        .record_event(None)
        .during("cuEventRecord")
        .and_then(|ev| next.wait(&ev).during("cuStreamWaitEvent"));
    // The event (if made) is destroyed when `record_event`'s value drops.
    counts::down(&counts::EVENTS);
    r
}
