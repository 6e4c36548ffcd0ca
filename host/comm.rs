//! [`Comm`]: a communicator with the shape of `cudarc::nccl::Comm`, so that
//! an engine written against cudarc's NCCL swaps its `use` line:
//!
//! ```text
//! - use cudarc::nccl::{Comm, Id, ReduceOp};
//! + use p2p_allreduce::comm::{Comm, Id, ReduceOp};
//! ```
//!
//! and keeps its calls: `Id::new()` on one rank, `id.internal()` passed to
//! the others (a file, a socket, the launcher), `Id::uninit(bytes)` there,
//! `Comm::from_rank(stream, rank, world_size, id)` in each process, or
//! `Comm::from_devices(streams)` for one thread per GPU in one process;
//! then `comm.all_reduce(&send, &mut recv, &ReduceOp::Sum)` and
//! `comm.all_reduce_in_place(&mut buf, &ReduceOp::Sum)`, `rank()`,
//! `world_size()`. What differs: the calls return this crate's
//! [`Result`]`<`[`Route`]`>` (which engine ran) instead of NCCL's status, and
//! `Id::new()` makes no NCCL id: its 128 bytes name a rendezvous directory
//! on this host (see [`Id`]), since the groups here are one host's.
//!
//! Two shapes, the two the Rust engines use:
//! - [`Comm::from_rank`]: one process per rank (mistral.rs, candle's
//!   `llama_multiprocess`), a [`ProcessGroup`] over CUDA IPC, set up
//!   through a [`DirExchange`] in the id's directory.
//! - [`Comm::from_devices`]: one thread per rank in one process
//!   (pegainfer), one [`PeerGroup`] shared by the ranks' communicators. A
//!   collective needs every rank's buffers in one launch of the group, so
//!   each rank's call waits (on the host) until every rank's thread has
//!   made it; the last to arrive enqueues the work of every rank, each on
//!   its rank's stream, and every call returns once it is enqueued (a
//!   host barrier per call; the device work stays asynchronous, as with
//!   NCCL). Ranks may share a GPU (two ranks on GPU 0 work; NCCL refuses).
//!
//! Plus [`Comm::all_reduce_add_rms_norm`]: the allreduce fused with the
//! residual add and RMSNorm that tensor-parallel blocks run next (one
//! kernel instead of NCCL + a norm kernel); bits as docs/numerics.md says.
//!
//! **What is served where.** The kernels sum f32, f16 and bf16
//! ([`ReduceOp::Sum`], bit-identical to [`crate::reference`] on every
//! rank). Any other [`ReduceOp`] or element type goes to an NCCL
//! communicator the `Comm` holds when this crate is built with feature
//! `nccl` (libnccl loaded at run time, one GPU per rank); otherwise it is
//! `Error::CommUnserved`, which says why. The decision is made in one
//! function, `route` (in `comm/route.rs`); a size-based choice (sizes where NCCL
//! is faster) plugs in there.
//!
//! **CUDA graphs.** Calls are staged: the input is copied into the group's
//! staging buffers, whose addresses never change, so a call captured in a
//! graph replays with whatever its buffers hold at replay time, like an
//! NCCL call. Every rank must capture the same calls in the same order.
//! With `from_devices`, each rank's thread captures its own stream (in
//! `ThreadLocal` or `Relaxed` capture mode, as one-thread-per-GPU NCCL
//! needs too); the thread that enqueues for every rank launches into the
//! other ranks' capturing streams, which CUDA allows. As with any cudarc
//! slice inside a capture, turn cudarc's event tracking off
//! (`CudaContext::disable_event_tracking`) before allocating the buffers
//! you capture, or the call is refused with `Error::CaptureInvalidated`.

use crate::abi::Dtype;
use crate::checks::check_world;
use crate::collective::settle;
use crate::driver;
use crate::element::DeviceElement;
use crate::error::{Error, Result};
use crate::exchange::DirExchange;
use crate::fused::norm_shape;
use crate::peer_group::{PeerGroup, Route};
use crate::plan::{AlgoChoice, Config};
use crate::process_group::ProcessGroup;
use cudarc::driver::{CudaContext, CudaStream, DevicePtr, DevicePtrMut};
use std::ffi::c_char;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

mod gather;
mod id;
mod route;

use gather::{Call, Gather, Threads};
pub use id::{Id, ID_BYTES, ID_MAX_PATH};
#[cfg(feature = "nccl")]
use route::{nccl_op, no_fallback, process_nccl, thread_nccl, Fallback};
use route::{route, Engine};
#[cfg(not(feature = "nccl"))]
use route::{unserved, NO_NCCL};

/// The reductions of `cudarc::nccl::ReduceOp`. The kernels serve `Sum`;
/// the others go to NCCL (feature `nccl`) or are `Error::CommUnserved`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReduceOp {
    Sum,
    Prod,
    Max,
    Min,
    Avg,
}

impl ReduceOp {
    /// `ncclRedOp_t` of nccl.h.
    pub const fn nccl_code(self) -> i32 {
        match self {
            ReduceOp::Sum => 0,
            ReduceOp::Prod => 1,
            ReduceOp::Max => 2,
            ReduceOp::Min => 3,
            ReduceOp::Avg => 4,
        }
    }
}

mod sealed {
    pub trait Sealed {}
}

/// The element types of [`Comm::all_reduce`]: those of
/// `cudarc::nccl::NcclType` (f32, f64, f16, bf16, i8, u8, i32, u32, i64,
/// u64). The kernels take f32, f16 and bf16 ([`DeviceElement`]); the others
/// go to NCCL.
pub trait CommElement: Copy + 'static + sealed::Sealed {
    /// The kernels' dtype, or `None` where only NCCL reduces this type.
    const KERNEL_DTYPE: Option<Dtype>;
    /// `ncclDataType_t` of nccl.h.
    const NCCL_TYPE: i32;
    /// The Rust name, for messages.
    const NAME: &'static str;
}

macro_rules! comm_element {
    ($t:ty, $kernel:expr, $nccl:expr, $name:expr) => {
        impl sealed::Sealed for $t {}
        impl CommElement for $t {
            const KERNEL_DTYPE: Option<Dtype> = $kernel;
            const NCCL_TYPE: i32 = $nccl;
            const NAME: &'static str = $name;
        }
    };
}
comm_element!(i8, None, 0, "i8");
comm_element!(u8, None, 1, "u8");
comm_element!(i32, None, 2, "i32");
comm_element!(u32, None, 3, "u32");
comm_element!(i64, None, 4, "i64");
comm_element!(u64, None, 5, "u64");
comm_element!(half::f16, Some(Dtype::F16), 6, "f16");
comm_element!(f32, Some(Dtype::F32), 7, "f32");
comm_element!(f64, None, 8, "f64");
comm_element!(half::bf16, Some(Dtype::Bf16), 9, "bf16");

/// How a communicator is formed. `Default`: the library's default
/// [`Config`], 300 s to wait for the other ranks, NCCL fallback on (with
/// feature `nccl`).
#[derive(Clone, Debug)]
pub struct CommOptions {
    /// The group's settings (every rank must pass the same).
    pub config: Config,
    /// How long a rank waits for the others: the rendezvous of
    /// `from_rank`, and each call of `from_devices` ranks (a rank whose
    /// thread never makes the call turns into `Error::CommTimeout`).
    pub timeout: Duration,
    /// Form an NCCL communicator beside the group for the calls the
    /// kernels do not serve (another `ReduceOp` or element type). When
    /// NCCL cannot be had (no libnccl on some rank, two ranks on one GPU),
    /// the communicator is formed without it and such calls say why.
    #[cfg(feature = "nccl")]
    pub nccl_fallback: bool,
}

impl Default for CommOptions {
    fn default() -> Self {
        CommOptions {
            config: Config::default(),
            timeout: Duration::from_secs(300),
            #[cfg(feature = "nccl")]
            nccl_fallback: true,
        }
    }
}

/// One rank of a communicator shaped like `cudarc::nccl::Comm` (see the
/// module docs). `Send + Sync`: move each rank's into its thread.
pub struct Comm {
    stream: Arc<CudaStream>,
    rank: usize,
    world: usize,
    inner: Inner,
}

enum Inner {
    Process(Box<ProcessRank>),
    Threads(Arc<Threads>),
}

/// A `from_rank` communicator's state.
struct ProcessRank {
    group: ProcessGroup,
    /// Kept for the group's later collective setup rounds (and NCCL's).
    _exchange: DirExchange,
    #[cfg(feature = "nccl")]
    nccl: Fallback<crate::nccl::NcclRank>,
}

impl std::fmt::Debug for Comm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let shape = match &self.inner {
            Inner::Process(_) => "from_rank (one process per rank)",
            Inner::Threads(_) => "from_devices (one thread per rank)",
        };
        f.debug_struct("Comm")
            .field("rank", &self.rank)
            .field("world_size", &self.world)
            .field("device", &self.stream.context().ordinal())
            .field("shape", &shape)
            .finish()
    }
}

impl Comm {
    /// This process's rank `rank` of `world_size`, on `stream`'s device,
    /// meeting the others in the directory `id` names (every rank passes
    /// the same id). As `cudarc::nccl::Comm::from_rank`; every rank calls it
    /// at the same point, and it returns when all have. Errors are typed:
    /// `NoDriver`, `CommId` (bytes that are not an id), `RendezvousTimeout`,
    /// `CrossHost`, ...
    pub fn from_rank(
        stream: Arc<CudaStream>,
        rank: usize,
        world_size: usize,
        id: Id,
    ) -> Result<Comm> {
        Comm::from_rank_with(stream, rank, world_size, id, CommOptions::default())
    }

    /// [`Comm::from_rank`] with [`CommOptions`].
    pub fn from_rank_with(
        stream: Arc<CudaStream>,
        rank: usize,
        world_size: usize,
        id: Id,
        options: CommOptions,
    ) -> Result<Comm> {
        check_world(world_size)?;
        let dir = id.dir()?;
        if !driver::driver_present() {
            return Err(Error::NoDriver);
        }
        let exchange = DirExchange::new(&dir, rank, world_size, options.timeout)?;
        let ctx = stream.context().clone();
        let group = ProcessGroup::new(&ctx, &exchange, options.config)?;
        #[cfg(feature = "nccl")]
        let nccl = process_nccl(&ctx, &exchange, options.nccl_fallback)?;
        Ok(Comm {
            stream,
            rank,
            world: world_size,
            inner: Inner::Process(Box::new(ProcessRank {
                group,
                _exchange: exchange,
                #[cfg(feature = "nccl")]
                nccl,
            })),
        })
    }

    /// One communicator per stream, rank r on `streams[r]` (several ranks
    /// may share a GPU, each on its own stream): one thread per rank, as
    /// `cudarc::nccl::Comm::from_devices` is used. Each rank's calls wait
    /// for the other ranks' threads (see the module docs): do not make the
    /// ranks' calls one after another from a single thread.
    pub fn from_devices(streams: Vec<Arc<CudaStream>>) -> Result<Vec<Comm>> {
        Comm::from_devices_with(streams, CommOptions::default())
    }

    /// [`Comm::from_devices`] with [`CommOptions`].
    pub fn from_devices_with(
        streams: Vec<Arc<CudaStream>>,
        options: CommOptions,
    ) -> Result<Vec<Comm>> {
        let world = streams.len();
        check_world(world)?;
        if !driver::driver_present() {
            return Err(Error::NoDriver);
        }
        let contexts: Vec<Arc<CudaContext>> = streams.iter().map(|s| s.context().clone()).collect();
        let group = PeerGroup::new(&contexts, options.config)?;
        #[cfg(feature = "nccl")]
        let nccl = thread_nccl(&streams, options.nccl_fallback);
        let shared = Arc::new(Threads {
            group,
            streams: streams.clone(),
            gather: Gather::new(world, options.timeout),
            #[cfg(feature = "nccl")]
            nccl,
        });
        Ok(streams
            .into_iter()
            .enumerate()
            .map(|(rank, stream)| Comm {
                stream,
                rank,
                world,
                inner: Inner::Threads(shared.clone()),
            })
            .collect())
    }

    pub fn rank(&self) -> usize {
        self.rank
    }
    pub fn world_size(&self) -> usize {
        self.world
    }
    /// The stream every call of this rank is enqueued on.
    pub fn stream(&self) -> Arc<CudaStream> {
        self.stream.clone()
    }
    pub fn context(&self) -> &Arc<CudaContext> {
        self.stream.context()
    }
    /// The device ordinal of this rank.
    pub fn ordinal(&self) -> usize {
        self.stream.context().ordinal()
    }

    /// The [`ProcessGroup`] of a `from_rank` communicator (for its zero-copy
    /// and graph calls), `None` for `from_devices`.
    pub fn process_group(&self) -> Option<&ProcessGroup> {
        match &self.inner {
            Inner::Process(p) => Some(&p.group),
            Inner::Threads(_) => None,
        }
    }

    /// The [`PeerGroup`] every rank of a `from_devices` communicator shares,
    /// `None` for `from_rank`.
    pub fn peer_group(&self) -> Option<&PeerGroup> {
        match &self.inner {
            Inner::Process(_) => None,
            Inner::Threads(t) => Some(&t.group),
        }
    }

    /// Reports an error a kernel of this communicator's group recorded (a
    /// peer timeout) without waiting for the device; every call asks the
    /// same first.
    pub fn poll(&self) -> Result<()> {
        match &self.inner {
            Inner::Process(p) => p.group.poll(),
            Inner::Threads(t) => t.group.poll(),
        }
    }

    /// Waits for this rank's stream (every rank's, for `from_devices`),
    /// then reports an error the group's kernels recorded.
    pub fn check(&self) -> Result<()> {
        match &self.inner {
            Inner::Process(p) => p.group.check(&self.stream),
            Inner::Threads(t) => t.group.check(&t.streams),
        }
    }

    /// Allreduce of this rank's `send` into `recv` (at least as long) on
    /// this rank's stream, as `cudarc::nccl::Comm::all_reduce`: every rank
    /// makes the same call with the same length. A `Sum` of f32, f16 or bf16
    /// runs the kernels (bit-identical on every rank, to
    /// [`crate::reference`]); another op or type goes to NCCL (feature
    /// `nccl`) or is `Error::CommUnserved`. Returns which engine ran.
    pub fn all_reduce<S, R, T>(&self, send: &S, recv: &mut R, op: &ReduceOp) -> Result<Route>
    where
        S: DevicePtr<T>,
        R: DevicePtrMut<T>,
        T: CommElement,
    {
        let count = send.len();
        if recv.len() < count {
            return Err(Error::BufferTooSmall {
                what: "recv",
                rank: self.rank,
                len: recv.len(),
                need: count,
            });
        }
        let engine = self.engine::<T>(*op, count)?;
        let (i, gi) = send.device_ptr(&self.stream);
        let (o, go) = recv.device_ptr_mut(&self.stream);
        // SAFETY: both come from live slices or views (distinct borrows, so
        // they do not overlap) of at least `count` elements on this rank's
        // stream, guarded until the work is enqueued.
        let r = unsafe { self.all_reduce_ptrs::<T>(engine, *op, count, i, o) };
        settle(r, (gi, go), &[&self.stream])
    }

    /// In-place allreduce of this rank's `buf`, as
    /// `cudarc::nccl::Comm::all_reduce_in_place` (what pegainfer calls
    /// before its add + RMSNorm: see [`Comm::all_reduce_add_rms_norm`]).
    pub fn all_reduce_in_place<R, T>(&self, buf: &mut R, op: &ReduceOp) -> Result<Route>
    where
        R: DevicePtrMut<T>,
        T: CommElement,
    {
        let count = buf.len();
        let engine = self.engine::<T>(*op, count)?;
        let (p, g) = buf.device_ptr_mut(&self.stream);
        // SAFETY: a live buffer of `count` elements on this rank's stream,
        // guarded until enqueued; the kernels stage their input and NCCL
        // allows in place.
        let r = unsafe { self.all_reduce_ptrs::<T>(engine, *op, count, p, p) };
        settle(r, g, &[&self.stream])
    }

    /// The fused allreduce + residual add + RMSNorm of this rank: `input`
    /// (rows x hidden, hidden = `gamma.len()`) is summed over the ranks,
    /// `residual` becomes `sum + residual`, and `normed` its RMSNorm times
    /// `gamma` (eps `eps`); one kernel, bits as docs/numerics.md says (the
    /// same on every rank). Every rank makes the same call with the same
    /// rows and hidden size. The kernels always run it (it has no NCCL
    /// form).
    pub fn all_reduce_add_rms_norm<T, I, R, G, O>(
        &self,
        input: &I,
        residual: &mut R,
        gamma: &G,
        eps: f32,
        normed: &mut O,
    ) -> Result<Route>
    where
        T: DeviceElement,
        I: DevicePtr<T>,
        R: DevicePtrMut<T>,
        G: DevicePtr<T>,
        O: DevicePtrMut<T>,
    {
        let (rows, hidden) = self.norm_shape(
            T::DTYPE,
            input.len(),
            residual.len(),
            gamma.len(),
            normed.len(),
            eps,
        )?;
        let (i, gi) = input.device_ptr(&self.stream);
        let (r, gr) = residual.device_ptr_mut(&self.stream);
        let (g, gg) = gamma.device_ptr(&self.stream);
        let (o, go) = normed.device_ptr_mut(&self.stream);
        // SAFETY: live slices or views on this rank's stream holding what
        // norm_shape checked, guarded until enqueued; distinct borrows, so
        // `normed` overlaps none of the others.
        let res = unsafe { self.add_rms_norm_ptrs(T::DTYPE, rows, hidden, eps, [i, r, g, o]) };
        settle(res, (gi, gr, gg, go), &[&self.stream])
    }

    /// [`Comm::all_reduce_add_rms_norm`] with the normed rows written over
    /// `x`, the input (staged: it is read before it is overwritten).
    pub fn all_reduce_add_rms_norm_in_place<T, X, R, G>(
        &self,
        x: &mut X,
        residual: &mut R,
        gamma: &G,
        eps: f32,
    ) -> Result<Route>
    where
        T: DeviceElement,
        X: DevicePtrMut<T>,
        R: DevicePtrMut<T>,
        G: DevicePtr<T>,
    {
        let (rows, hidden) =
            self.norm_shape(T::DTYPE, x.len(), residual.len(), gamma.len(), x.len(), eps)?;
        let (p, gx) = x.device_ptr_mut(&self.stream);
        let (r, gr) = residual.device_ptr_mut(&self.stream);
        let (g, gg) = gamma.device_ptr(&self.stream);
        // SAFETY: as for all_reduce_add_rms_norm; `x` is both the (staged)
        // input and the output, and overlaps neither residual nor gamma
        // (distinct borrows).
        let res = unsafe { self.add_rms_norm_ptrs(T::DTYPE, rows, hidden, eps, [p, r, g, p]) };
        settle(res, (gx, gr, gg), &[&self.stream])
    }

    /// This rank's fused-call shape, with this rank named in the errors.
    fn norm_shape(
        &self,
        dtype: Dtype,
        input: usize,
        residual: usize,
        gamma: usize,
        normed: usize,
        eps: f32,
    ) -> Result<(usize, usize)> {
        let one = std::iter::once;
        norm_shape(
            dtype,
            one(input),
            one(residual),
            one(gamma),
            one(normed),
            eps,
        )
        .map_err(|e| e.at_rank(self.rank))
    }

    /// Whether the group's `Auto` table gives `count` elements of `dtype`
    /// to NCCL and this communicator holds an NCCL fallback to run them.
    fn nccl_wins(&self, count: usize, dtype: Dtype) -> bool {
        #[cfg(feature = "nccl")]
        {
            self.nccl_missing().is_none()
                && match &self.inner {
                    Inner::Process(p) => p.group.nccl_wins(count, dtype),
                    Inner::Threads(t) => t.group.nccl_wins(count, dtype),
                }
        }
        #[cfg(not(feature = "nccl"))]
        {
            let _ = (count, dtype);
            false
        }
    }

    /// Why this communicator has no NCCL fallback, or `None` if it has one.
    #[cfg(feature = "nccl")]
    fn nccl_missing(&self) -> Option<&str> {
        match &self.inner {
            Inner::Process(p) => p.nccl.as_ref().err(),
            Inner::Threads(t) => t.nccl.as_ref().err(),
        }
        .map(String::as_str)
    }

    /// The engine of a call of `count` elements, or the error of a call
    /// nobody here serves.
    fn engine<T: CommElement>(&self, op: ReduceOp, count: usize) -> Result<Engine> {
        let engine = route::<T>(op, |dtype| self.nccl_wins(count, dtype));
        if let Engine::Nccl(_) = engine {
            #[cfg(feature = "nccl")]
            if let Some(why) = self.nccl_missing() {
                return Err(no_fallback::<T>(op, why));
            }
            #[cfg(not(feature = "nccl"))]
            return Err(unserved::<T>(op, NO_NCCL.into()));
        }
        Ok(engine)
    }

    /// Enqueues this rank's allreduce of `count` elements of `T` with `op`
    /// on the engine chosen by [`Comm::engine`].
    ///
    /// # Safety
    /// `input` valid for reads and `output` for writes of `count` elements
    /// of `T` on this rank's device until the work on its stream completes;
    /// they are equal or do not overlap.
    unsafe fn all_reduce_ptrs<T: CommElement>(
        &self,
        engine: Engine,
        op: ReduceOp,
        count: usize,
        input: u64,
        output: u64,
    ) -> Result<Route> {
        match (&self.inner, engine) {
            (Inner::Process(p), Engine::Kernels(dtype)) => {
                // SAFETY: forwarded from the caller (staged: in place is
                // allowed).
                unsafe {
                    p.group.allreduce_raw(
                        &self.stream,
                        dtype,
                        count,
                        input,
                        output,
                        AlgoChoice::Auto,
                    )
                }
                .map(Route::Kernel)
            }
            #[cfg(feature = "nccl")]
            (Inner::Process(p), Engine::Nccl(_)) => {
                let nccl = p.nccl.as_ref().map_err(|why| no_fallback::<T>(op, why))?;
                p.group.poll()?;
                // SAFETY: forwarded from the caller.
                unsafe {
                    nccl.allreduce_op_raw(&self.stream, nccl_op::<T>(op), count, input, output)
                }
                .map(|()| Route::Nccl)
            }
            (Inner::Threads(t), Engine::Kernels(dtype)) => {
                let call = Call::AllReduce {
                    dtype,
                    count,
                    input,
                    output,
                };
                t.gather
                    .join(self.rank, call, |calls, me| t.launch(calls, me))
            }
            #[cfg(feature = "nccl")]
            (Inner::Threads(t), Engine::Nccl(_)) => {
                let call = Call::Nccl {
                    op: nccl_op::<T>(op),
                    count,
                    input,
                    output,
                };
                t.gather
                    .join(self.rank, call, |calls, me| t.launch(calls, me))
            }
            #[cfg(not(feature = "nccl"))]
            (_, Engine::Nccl(_)) => Err(unserved::<T>(op, NO_NCCL.into())),
        }
    }

    /// Enqueues this rank's fused call over `[input, residual, gamma,
    /// normed]`.
    ///
    /// # Safety
    /// As `ProcessGroup::allreduce_add_rmsnorm_raw` for this rank.
    unsafe fn add_rms_norm_ptrs(
        &self,
        dtype: Dtype,
        rows: usize,
        hidden: usize,
        eps: f32,
        ptrs: [u64; 4],
    ) -> Result<Route> {
        match &self.inner {
            Inner::Process(p) => {
                // SAFETY: forwarded from the caller.
                unsafe {
                    p.group.allreduce_add_rmsnorm_raw(
                        &self.stream,
                        dtype,
                        rows,
                        hidden,
                        eps,
                        ptrs,
                        AlgoChoice::Auto,
                    )
                }
                .map(Route::Kernel)
            }
            Inner::Threads(t) => {
                let call = Call::AddRmsNorm {
                    dtype,
                    rows,
                    hidden,
                    eps_bits: eps.to_bits(),
                    ptrs,
                };
                t.gather
                    .join(self.rank, call, |calls, me| t.launch(calls, me))
            }
        }
    }
}

#[cfg(test)]
mod tests;
