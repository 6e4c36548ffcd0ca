//! CUDA IPC: exporting an allocation as a handle, mapping a peer
//! process's allocation from its handle.

use super::record_drop_error;
use crate::error::{Context as _, Result};
use cudarc::driver::{sys, CudaContext};
use std::sync::Arc;

/// Bytes of a CUDA IPC memory handle.
pub const IPC_HANDLE_BYTES: usize = 64;

/// The allocation holding device address `ptr`: `(base, size)`.
pub fn address_range(ctx: &Arc<CudaContext>, ptr: u64) -> Result<(u64, usize)> {
    ctx.bind_to_thread().during("cuCtxSetCurrent")?;
    let mut base: sys::CUdeviceptr = 0;
    let mut size: usize = 0;
    // SAFETY: plain query with valid out-pointers; the driver checks `ptr`.
    unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut size, ptr) }
        .result()
        .during("cuMemGetAddressRange")?;
    Ok((base, size))
}

/// Exports the allocation starting at `base` (from plain `cuMemAlloc`) as a
/// CUDA IPC handle.
pub fn ipc_export(ctx: &Arc<CudaContext>, base: u64) -> Result<[u8; IPC_HANDLE_BYTES]> {
    ctx.bind_to_thread().during("cuCtxSetCurrent")?;
    let mut h = std::mem::MaybeUninit::<sys::CUipcMemHandle>::zeroed();
    // SAFETY: the handle is plain bytes written by the driver; the driver
    // rejects a `base` that is not the start of an exportable allocation.
    unsafe { sys::cuIpcGetMemHandle(h.as_mut_ptr(), base) }
        .result()
        .during(
            "cuIpcGetMemHandle (the buffer must come from plain cuMemAlloc, not a stream-ordered pool)",
        )?;
    // SAFETY: zero-initialised, then written by the driver.
    let h = unsafe { h.assume_init() };
    let mut out = [0u8; IPC_HANDLE_BYTES];
    for (o, c) in out.iter_mut().zip(h.reserved.iter()) {
        *o = *c as u8;
    }
    Ok(out)
}

/// A peer process's allocation mapped into this process through its CUDA
/// IPC handle; unmapped on drop.
pub struct IpcMapping {
    ctx: Arc<CudaContext>,
    ptr: u64,
    /// Bytes mapped from `ptr` to the end of the allocation, as the driver
    /// reports them (`cuMemGetAddressRange`).
    bytes: u64,
}

impl IpcMapping {
    /// Maps the allocation behind `handle` into `ctx` (peer access is
    /// enabled lazily by the driver when the owner is another device), and
    /// reads how large the mapped allocation is ([`IpcMapping::bytes`]): a
    /// handle says nothing about its size, so every use of the mapping is
    /// checked against what the driver reports.
    pub fn open(ctx: &Arc<CudaContext>, handle: &[u8; IPC_HANDLE_BYTES]) -> Result<Self> {
        let mut h = sys::CUipcMemHandle {
            reserved: [0; IPC_HANDLE_BYTES],
        };
        for (d, b) in h.reserved.iter_mut().zip(handle) {
            *d = *b as _;
        }
        ctx.bind_to_thread().during("cuCtxSetCurrent")?;
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: `h` is a handle exported by a peer process; the driver
        // validates it and writes the mapped address.
        unsafe {
            sys::cuIpcOpenMemHandle_v2(
                &mut ptr,
                h,
                sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
            )
        }
        .result()
        .during("cuIpcOpenMemHandle")?;
        super::counts::up(&super::counts::IPC_MAPPINGS);
        let mut m = IpcMapping {
            ctx: ctx.clone(),
            ptr,
            bytes: 0,
        };
        // On an error here `m` is dropped, which unmaps it.
        let (base, size) = address_range(ctx, ptr)?;
        m.bytes = base.saturating_add(size as u64).saturating_sub(ptr);
        Ok(m)
    }
    pub fn ptr(&self) -> u64 {
        self.ptr
    }
    /// Bytes of the peer's allocation mapped from [`IpcMapping::ptr`] on.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }
}

impl Drop for IpcMapping {
    fn drop(&mut self) {
        let r = self.ctx.bind_to_thread().and_then(|()| {
            // SAFETY: `ptr` came from cuIpcOpenMemHandle and is closed once.
            unsafe { sys::cuIpcCloseMemHandle(self.ptr) }.result()
        });
        super::counts::down(&super::counts::IPC_MAPPINGS);
        record_drop_error(&self.ctx, r);
    }
}
