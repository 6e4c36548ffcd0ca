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
        record_drop_error(&self.ctx, r);
    }
}
