//! A word of pinned host memory the kernels write and the host reads
//! without synchronising.

use super::record_drop_error;
use crate::error::{Context as _, Result};
use cudarc::driver::{result, sys, CudaContext};
use std::sync::Arc;

/// One `u32` of pinned host memory mapped into the device's address space:
/// kernels write it (system scope), the host reads it without any device
/// synchronisation. Used as the error mailbox of a group's launches.
pub struct HostMailbox {
    ctx: Arc<CudaContext>,
    host: *mut u32,
    device: u64,
}

// SAFETY: the pointer is to pinned host memory owned by this value; the
// host only reads or writes it with volatile single-word accesses.
unsafe impl Send for HostMailbox {}
// SAFETY: as above; concurrent volatile word reads/writes are fine.
unsafe impl Sync for HostMailbox {}

impl HostMailbox {
    pub fn new(ctx: &Arc<CudaContext>) -> Result<Self> {
        ctx.bind_to_thread().during("cuCtxSetCurrent")?;
        // SAFETY: a plain allocation of 4 bytes with the documented flags.
        let host = unsafe {
            result::malloc_host(
                std::mem::size_of::<u32>(),
                sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE,
            )
        }
        .during("cuMemHostAlloc (error mailbox)")? as *mut u32;
        let mut device: sys::CUdeviceptr = 0;
        // SAFETY: `host` was just allocated as device-mapped pinned memory;
        // the out-pointer is valid.
        let r = unsafe { sys::cuMemHostGetDevicePointer_v2(&mut device, host.cast(), 0) };
        let mb = HostMailbox {
            ctx: ctx.clone(),
            host,
            device,
        };
        super::counts::up(&super::counts::HOST_PINNED);
        r.result().during("cuMemHostGetDevicePointer")?;
        mb.clear();
        Ok(mb)
    }
    /// The address kernels write to.
    pub fn device_ptr(&self) -> u64 {
        self.device
    }
    /// The code a kernel left here (0: none).
    pub fn read(&self) -> u32 {
        // SAFETY: `host` is a live, aligned u32 of pinned memory owned by self.
        unsafe { std::ptr::read_volatile(self.host) }
    }
    pub fn clear(&self) {
        // SAFETY: as in `read`.
        unsafe { std::ptr::write_volatile(self.host, 0) }
    }
}

impl Drop for HostMailbox {
    fn drop(&mut self) {
        let r = self.ctx.bind_to_thread().and_then(|()| {
            // SAFETY: allocated by cuMemHostAlloc in `new`, freed once.
            unsafe { result::free_host(self.host.cast()) }
        });
        super::counts::down(&super::counts::HOST_PINNED);
        record_drop_error(&self.ctx, r);
    }
}

/// Pinned host memory mapped into the device's address space, `bytes`
/// long: what kernels read and write across the GPU's host link
/// (`p2p-allreduce hostlink`).
pub struct HostMapped {
    ctx: Arc<CudaContext>,
    host: *mut u8,
    device: u64,
    bytes: usize,
}

// SAFETY: the pointer is to pinned host memory owned by this value, which
// the host never dereferences (only the device reads and writes it).
unsafe impl Send for HostMapped {}
// SAFETY: as above.
unsafe impl Sync for HostMapped {}

impl HostMapped {
    pub fn new(ctx: &Arc<CudaContext>, bytes: usize) -> Result<Self> {
        ctx.bind_to_thread().during("cuCtxSetCurrent")?;
        // SAFETY: a plain allocation with the documented flags.
        let host = unsafe {
            result::malloc_host(
                bytes.max(1),
                sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE,
            )
        }
        .during("cuMemHostAlloc (mapped)")? as *mut u8;
        let mut device: sys::CUdeviceptr = 0;
        // SAFETY: `host` was just allocated as device-mapped pinned memory;
        // the out-pointer is valid.
        let r = unsafe { sys::cuMemHostGetDevicePointer_v2(&mut device, host.cast(), 0) };
        let m = HostMapped {
            ctx: ctx.clone(),
            host,
            device,
            bytes,
        };
        super::counts::up(&super::counts::HOST_PINNED);
        r.result().during("cuMemHostGetDevicePointer")?;
        // SAFETY: `host` is `bytes` of live pinned memory owned by `m`.
        unsafe { std::ptr::write_bytes(m.host, 0x3c, bytes) };
        Ok(m)
    }
    /// The address kernels use.
    pub fn device_ptr(&self) -> u64 {
        self.device
    }
    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

impl Drop for HostMapped {
    fn drop(&mut self) {
        let r = self.ctx.bind_to_thread().and_then(|()| {
            // SAFETY: allocated by cuMemHostAlloc in `new`, freed once.
            unsafe { result::free_host(self.host.cast()) }
        });
        super::counts::down(&super::counts::HOST_PINNED);
        record_drop_error(&self.ctx, r);
    }
}
