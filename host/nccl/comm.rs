//! NCCL communicators: all ranks in this process ([`NcclGroup`]) or this
//! process's rank of several ([`NcclRank`]).

use super::{
    api, check, nccl_dtype, unique_id, Api, NcclOp, RawComm, UniqueId, NCCL_SUM, UNIQUE_ID_BYTES,
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
        let op = NcclOp {
            data_type: nccl_dtype(dtype),
            op: NCCL_SUM,
        };
        // SAFETY: forwarded from the caller.
        unsafe { self.all_reduce_op(a, stream, op, count, input, output) }
    }

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
        let op = NcclOp {
            data_type: nccl_dtype(dtype),
            op: NCCL_SUM,
        };
        // SAFETY: forwarded from the caller.
        unsafe { self.allreduce_op_raw(streams, op, count, inputs, outputs) }
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
