//! NCCL communicators: all ranks in this process ([`NcclGroup`]) or this
//! process's rank of several ([`NcclRank`]).

use super::{
    api, check, symmetric_api, unique_id, Api, NcclOp, RawComm, RawWindow, SymmetricApi, UniqueId,
    NCCL_WIN_COLL_SYMMETRIC, UNIQUE_ID_BYTES,
};
use crate::abi::Dtype;
use crate::element::DeviceElement;
use crate::error::{Error, Result};
use cudarc::driver::{CudaContext, CudaStream, DevicePtr, DevicePtrMut};
use std::ffi::{c_char, c_int, c_void};
use std::sync::{Arc, Mutex};

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
    /// Enqueues `ncclAllReduce` of `count` elements with `op`'s type and
    /// reduction on `stream`.
    ///
    /// # Safety
    /// `input` and `output` must be valid for `count` elements of
    /// `op.data_type` on this communicator's device until the work on
    /// `stream` completes.
    unsafe fn all_reduce_op(
        &self,
        a: &Api,
        stream: &CudaStream,
        op: NcclOp,
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
                op.data_type,
                op.op,
                self.raw,
                stream.cu_stream() as *mut c_void,
            )
        };
        check(a, r, "ncclAllReduce")
    }
}

/// One rank's buffer from `ncclMemAlloc`, registered as a symmetric window
/// (null window: not registered yet).
struct WindowBuf {
    ptr: *mut c_void,
    win: RawWindow,
}

// SAFETY: the pointer and the window handle are plain addresses of device
// memory and of NCCL's registration, usable from any thread; they are only
// freed and deregistered in `Windows`' drop, with the owning communicator's
// context bound, and the owners serialise every use of them as for `Comm`.
unsafe impl Send for WindowBuf {}
// SAFETY: as above: shared references only read the addresses.
unsafe impl Sync for WindowBuf {}

/// Input and output buffers of every rank of this process, in NCCL's
/// symmetric windows: `ncclAllReduce` on them may run NCCL's symmetric
/// kernels (NCCL >= 2.27). Read through [`SymmetricBuffers`].
struct Windows {
    bytes: usize,
    /// `bufs[i]`: the i-th communicator's (input, output).
    bufs: Vec<[WindowBuf; 2]>,
}

/// Where the symmetric buffers are: `inputs[i]`/`outputs[i]` of `bytes`
/// bytes each on the i-th rank (of this process) and its device.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SymmetricBuffers {
    pub bytes: usize,
    pub inputs: Vec<u64>,
    pub outputs: Vec<u64>,
}

fn symmetric_or_err() -> Result<&'static SymmetricApi> {
    symmetric_api().map_err(|e| Error::Nccl(format!("symmetric windows unavailable: {e}")))
}

impl Windows {
    /// Allocates and registers an input and an output of `bytes` bytes on
    /// every communicator of `comms` (all of this process's ranks: the
    /// registration is collective, so with several they are grouped).
    fn new(a: &Api, comms: &[&Comm], bytes: usize) -> Result<Windows> {
        let s = symmetric_or_err()?;
        let bytes = bytes.max(1);
        let mut w = Windows {
            bytes,
            bufs: Vec::with_capacity(comms.len()),
        };
        for c in comms {
            let mut pair = [std::ptr::null_mut(), std::ptr::null_mut()];
            let mut failed = bind(c).err();
            for p in &mut pair {
                if failed.is_some() {
                    break;
                }
                // SAFETY: valid out-pointer; the device is current.
                let r = unsafe { (s.mem_alloc)(p, bytes) };
                if let Err(e) = check(a, r, "ncclMemAlloc") {
                    // Nothing was allocated into it.
                    *p = std::ptr::null_mut();
                    failed = Some(e);
                }
            }
            // Pushed even when incomplete, so that `release` frees it.
            w.bufs.push(pair.map(|ptr| WindowBuf {
                ptr,
                win: std::ptr::null_mut(),
            }));
            if let Some(e) = failed {
                w.release(a, comms);
                return Err(e);
            }
        }
        let grouped = comms.len() > 1;
        if grouped {
            // SAFETY: plain call; matched by the ncclGroupEnd below.
            if let Err(e) = check(a, unsafe { (a.group_start)() }, "ncclGroupStart") {
                w.release(a, comms);
                return Err(e);
            }
        }
        let mut first = Ok(());
        for (c, pair) in comms.iter().zip(&mut w.bufs) {
            for b in pair.iter_mut() {
                if first.is_err() {
                    break;
                }
                first = bind(c).and_then(|()| {
                    // SAFETY: `b.ptr` is a live ncclMemAlloc buffer of
                    // `bytes` bytes on this communicator's device; valid
                    // out-pointer for the window.
                    let r = unsafe {
                        (s.window_register)(
                            c.raw,
                            b.ptr,
                            bytes,
                            &mut b.win,
                            NCCL_WIN_COLL_SYMMETRIC,
                        )
                    };
                    check(a, r, "ncclCommWindowRegister")
                });
            }
        }
        if grouped {
            // SAFETY: matches the ncclGroupStart above.
            let end = check(a, unsafe { (a.group_end)() }, "ncclGroupEnd");
            if first.is_ok() {
                first = end;
            }
        }
        if let Err(e) = first {
            w.release(a, comms);
            return Err(e);
        }
        Ok(w)
    }

    fn buffers(&self) -> SymmetricBuffers {
        SymmetricBuffers {
            bytes: self.bytes,
            inputs: self.bufs.iter().map(|p| p[0].ptr as u64).collect(),
            outputs: self.bufs.iter().map(|p| p[1].ptr as u64).collect(),
        }
    }

    /// Deregisters the windows (grouped, as registered) and frees the
    /// buffers; errors are ignored (this runs on drop).
    fn release(&mut self, a: &Api, comms: &[&Comm]) {
        let Ok(s) = symmetric_or_err() else {
            return;
        };
        let grouped = comms.len() > 1;
        // SAFETY: plain call; matched below.
        let started = grouped && unsafe { (a.group_start)() } == 0;
        for (c, pair) in comms.iter().zip(&mut self.bufs) {
            for b in pair.iter_mut().filter(|b| !b.win.is_null()) {
                if bind(c).is_ok() {
                    // SAFETY: the window was registered on this
                    // communicator and is deregistered once.
                    let _ = unsafe { (s.window_deregister)(c.raw, b.win) };
                }
                b.win = std::ptr::null_mut();
            }
        }
        if started {
            // SAFETY: matches the ncclGroupStart above.
            let _ = unsafe { (a.group_end)() };
        }
        for (c, pair) in comms.iter().zip(&mut self.bufs) {
            for b in pair.iter_mut().filter(|b| !b.ptr.is_null()) {
                if bind(c).is_ok() {
                    // SAFETY: from ncclMemAlloc, no longer registered,
                    // freed once; the device's work on it is done (drop
                    // after the caller synchronised, as for any buffer).
                    let _ = unsafe { (s.mem_free)(b.ptr) };
                }
                b.ptr = std::ptr::null_mut();
            }
        }
        self.bufs.clear();
    }
}

fn bind(c: &Comm) -> Result<()> {
    c.ctx
        .bind_to_thread()
        .map_err(|e| Error::Nccl(format!("cuCtxSetCurrent: {e}")))
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
    windows: Option<Windows>,
    lock: Mutex<()>,
}

impl Drop for NcclGroup {
    fn drop(&mut self) {
        // Windows go before their communicators.
        if let (Some(mut w), Ok(a)) = (self.windows.take(), api()) {
            let comms: Vec<&Comm> = self.comms.iter().collect();
            w.release(a, &comms);
        }
    }
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
            windows: None,
            lock: Mutex::new(()),
        })
    }

    pub fn world(&self) -> usize {
        self.comms.len()
    }

    /// Allocates, on every rank, an input and an output of `bytes` bytes
    /// with `ncclMemAlloc` and registers them as symmetric windows, so that
    /// allreduces between them ([`NcclGroup::symmetric`]'s pointers, through
    /// [`NcclGroup::allreduce_raw`]) may use NCCL's symmetric kernels.
    /// Replaces earlier windows. Needs NCCL >= 2.27: else `Error::Nccl`
    /// with [`super::SymmetricUnavailable`]'s reason.
    pub fn enable_symmetric(&mut self, bytes: usize) -> Result<SymmetricBuffers> {
        let a = api()?;
        let comms: Vec<&Comm> = self.comms.iter().collect();
        if let Some(mut old) = self.windows.take() {
            old.release(a, &comms);
        }
        let _one_at_a_time = self.lock.lock().unwrap_or_else(|p| p.into_inner());
        let w = Windows::new(a, &comms, bytes)?;
        let b = w.buffers();
        self.windows = Some(w);
        Ok(b)
    }

    /// The symmetric buffers, if [`NcclGroup::enable_symmetric`] made them.
    pub fn symmetric(&self) -> Option<SymmetricBuffers> {
        self.windows.as_ref().map(Windows::buffers)
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
        // SAFETY: forwarded from the caller.
        unsafe { self.allreduce_op_raw(streams, NcclOp::sum(dtype), count, inputs, outputs) }
    }

    /// [`NcclGroup::allreduce_raw`] with any NCCL data type and reduction
    /// (`op`).
    ///
    /// # Safety
    /// `inputs[r]`/`outputs[r]` valid for `count` elements of
    /// `op.data_type` on rank r's device until the work on `streams[r]`
    /// completes.
    pub(crate) unsafe fn allreduce_op_raw(
        &self,
        streams: &[Arc<CudaStream>],
        op: NcclOp,
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
                unsafe { comm.all_reduce_op(a, &streams[r], op, count, inputs[r], outputs[r]) };
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
    windows: Option<Windows>,
    rank: usize,
    world: usize,
    lock: Mutex<()>,
}

impl Drop for NcclRank {
    fn drop(&mut self) {
        // Windows go before the communicator.
        if let (Some(mut w), Ok(a)) = (self.windows.take(), api()) {
            w.release(a, &[&self.comm]);
        }
    }
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
            windows: None,
            rank,
            world,
            lock: Mutex::new(()),
        })
    }

    /// [`NcclGroup::enable_symmetric`] for this rank: a collective call,
    /// every rank with the same `bytes`.
    pub fn enable_symmetric(&mut self, bytes: usize) -> Result<SymmetricBuffers> {
        let a = api()?;
        if let Some(mut old) = self.windows.take() {
            old.release(a, &[&self.comm]);
        }
        let _one_at_a_time = self.lock.lock().unwrap_or_else(|p| p.into_inner());
        let w = Windows::new(a, &[&self.comm], bytes)?;
        let b = w.buffers();
        self.windows = Some(w);
        Ok(b)
    }

    /// This rank's symmetric buffers (one input, one output), if made.
    pub fn symmetric(&self) -> Option<SymmetricBuffers> {
        self.windows.as_ref().map(Windows::buffers)
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
        // SAFETY: forwarded from the caller.
        unsafe { self.allreduce_op_raw(stream, NcclOp::sum(dtype), count, input, output) }
    }

    /// [`NcclRank::allreduce_raw`] with any NCCL data type and reduction
    /// (`op`).
    ///
    /// # Safety
    /// `input`/`output` valid for `count` elements of `op.data_type` on
    /// this rank's device until the work on `stream` completes.
    pub(crate) unsafe fn allreduce_op_raw(
        &self,
        stream: &CudaStream,
        op: NcclOp,
        count: usize,
        input: u64,
        output: u64,
    ) -> Result<()> {
        let a = api()?;
        let _one_at_a_time = self.lock.lock().unwrap_or_else(|p| p.into_inner());
        // SAFETY: forwarded from the caller.
        unsafe { self.comm.all_reduce_op(a, stream, op, count, input, output) }
    }
}
