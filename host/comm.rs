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
//! function, `route` (in this file); a size-based choice (sizes where NCCL
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

/// Bytes of an [`Id`], as of `ncclUniqueId`.
pub const ID_BYTES: usize = 128;
/// The first bytes of every id (format version 1).
const ID_MAGIC: &[u8; 8] = b"P2PARID1";
/// Room for the directory's path: after the magic and one length byte.
pub const ID_MAX_PATH: usize = ID_BYTES - ID_MAGIC.len() - 1;

/// What ranks share to form one [`Comm::from_rank`] group: 128 bytes, as
/// `ncclUniqueId`, that name a rendezvous directory on this host (absolute
/// path, at most [`ID_MAX_PATH`] bytes). [`Id::new`] creates a fresh private
/// one (mode 0700) in the temporary directory; the ranks meet there through
/// a [`DirExchange`] (files, no server). Pass [`Id::internal`] (or
/// [`Id::to_bytes`]) to every rank unchanged; one id per group.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Id {
    internal: [c_char; ID_BYTES],
}

impl std::fmt::Debug for Id {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.dir() {
            Ok(d) => f.debug_struct("Id").field("dir", &d).finish(),
            Err(_) => f.debug_struct("Id").field("dir", &"<not an id>").finish(),
        }
    }
}

impl Id {
    /// A fresh rendezvous directory, created (mode 0700) under
    /// `std::env::temp_dir()`, named in a new id. On one rank; the others
    /// get the bytes. `Error::CommId` when the temporary directory's path
    /// is too long for 128 bytes (set `TMPDIR` to a shorter one, or use
    /// [`Id::for_dir`]).
    pub fn new() -> Result<Id> {
        use std::hash::{BuildHasher, Hasher};
        let base = std::env::temp_dir();
        let mut last = None;
        for attempt in 0u32..16 {
            let mut h = std::collections::hash_map::RandomState::new().build_hasher();
            h.write_u32(attempt);
            let nonce = h.finish();
            let dir = base.join(format!("p2p-allreduce-{}-{nonce:016x}", std::process::id()));
            // Check that it fits before creating anything.
            let id = Id::for_dir(&dir)?;
            let mut b = std::fs::DirBuilder::new();
            #[cfg(unix)]
            {
                use std::os::unix::fs::DirBuilderExt;
                // The peers' IPC handles will lie here: this user only.
                b.mode(0o700);
            }
            match b.create(&dir) {
                Ok(()) => return Ok(id),
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => last = Some(e),
                Err(e) => {
                    return Err(Error::Rendezvous(format!(
                        "creating the id's directory {}: {e}",
                        dir.display()
                    )))
                }
            }
        }
        Err(Error::Rendezvous(format!(
            "no fresh directory under {} after 16 tries: {last:?}",
            base.display()
        )))
    }

    /// An id naming `dir` (absolute, at most [`ID_MAX_PATH`] bytes): the
    /// ranks will meet there (it is created, mode 0700, if missing). Use a
    /// fresh directory per group.
    pub fn for_dir(dir: &Path) -> Result<Id> {
        use std::os::unix::ffi::OsStrExt;
        let path = dir.as_os_str().as_bytes();
        if !dir.is_absolute() {
            return Err(Error::CommId {
                reason: format!("{} is not an absolute path", dir.display()),
            });
        }
        if path.len() > ID_MAX_PATH || path.contains(&0) {
            return Err(Error::CommId {
                reason: format!(
                    "the directory {} takes {} bytes, more than the {ID_MAX_PATH} an id holds (or holds a NUL); \
                     set TMPDIR to a shorter directory or pass one to Id::for_dir",
                    dir.display(),
                    path.len()
                ),
            });
        }
        let mut bytes = [0u8; ID_BYTES];
        bytes[..ID_MAGIC.len()].copy_from_slice(ID_MAGIC);
        bytes[ID_MAGIC.len()] = path.len() as u8;
        bytes[ID_MAGIC.len() + 1..][..path.len()].copy_from_slice(path);
        Ok(Id::from_bytes(bytes))
    }

    /// The id from its 128 bytes as [`Id::internal`] gave them (cudarc's
    /// signature); checked when a communicator is formed from it.
    pub fn uninit(internal: [c_char; ID_BYTES]) -> Id {
        Id { internal }
    }

    /// The 128 bytes to pass to the other ranks (cudarc's signature).
    pub fn internal(&self) -> &[c_char; ID_BYTES] {
        &self.internal
    }

    /// [`Id::internal`] as bytes (for a file or a socket).
    pub fn to_bytes(&self) -> [u8; ID_BYTES] {
        self.internal.map(|c| c as u8)
    }

    /// [`Id::uninit`] from bytes.
    pub fn from_bytes(bytes: [u8; ID_BYTES]) -> Id {
        Id {
            internal: bytes.map(|b| b as c_char),
        }
    }

    /// The rendezvous directory this id names, or `Error::CommId` for bytes
    /// that are not an id of this crate (an NCCL id, a truncated file).
    pub fn dir(&self) -> Result<PathBuf> {
        use std::os::unix::ffi::OsStrExt;
        let b = self.to_bytes();
        let bad = |reason: String| Err(Error::CommId { reason });
        if &b[..ID_MAGIC.len()] != ID_MAGIC {
            return bad("it does not start with P2PARID1".into());
        }
        let len = b[ID_MAGIC.len()] as usize;
        if len == 0 || len > ID_MAX_PATH {
            return bad(format!(
                "its path length {len} is outside 1..={ID_MAX_PATH}"
            ));
        }
        let (path, rest) = b[ID_MAGIC.len() + 1..].split_at(len);
        if rest.iter().any(|&x| x != 0) || path.contains(&0) {
            return bad("bytes past its path are not zero".into());
        }
        let dir = PathBuf::from(std::ffi::OsStr::from_bytes(path));
        if !dir.is_absolute() {
            return bad(format!("{} is not an absolute path", dir.display()));
        }
        Ok(dir)
    }
}

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

/// Why a call is not the kernels'.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Unserved {
    /// A reduction other than `Sum`.
    Op(ReduceOp),
    /// An element type without kernels.
    Type(&'static str),
}

/// Which engine runs an allreduce.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Engine {
    Kernels(Dtype),
    Nccl(Unserved),
}

/// Which engine serves an allreduce of `op` over `T`: **the one place
/// where a `Comm` routes its calls.** Today by what the kernels compute
/// (a `Sum` of f32, f16 or bf16); everything else is NCCL's.
///
/// A size-based decision (issue 44: sizes and links where NCCL is the
/// faster one, e.g. a `nccl_wins(link, world, dtype, bytes)` table) plugs in
/// here: give this function the message's bytes and the group's link and
/// world, and return `Engine::Nccl` (with a new `Unserved` reason, say
/// `Size`) where NCCL wins; the callers already send `Engine::Nccl` to the
/// communicator's NCCL fallback and report it where there is none. (The
/// fused `all_reduce_add_rms_norm` has no NCCL form and is not routed.)
fn route<T: CommElement>(op: ReduceOp) -> Engine {
    match (op, T::KERNEL_DTYPE) {
        (ReduceOp::Sum, Some(dtype)) => Engine::Kernels(dtype),
        (ReduceOp::Sum, None) => Engine::Nccl(Unserved::Type(T::NAME)),
        (op, _) => Engine::Nccl(Unserved::Op(op)),
    }
}

/// `Error::CommUnserved` for a call of `op` over `T` that NCCL cannot take
/// because `why`.
fn unserved<T: CommElement>(op: ReduceOp, why: String) -> Error {
    Error::CommUnserved {
        what: format!("ReduceOp::{op:?} over {}", T::NAME),
        why,
        fix: if cfg!(feature = "nccl") {
            "sum f32, f16 or bf16, or make the NCCL fallback available (libnccl on this machine, one GPU \
             per rank, CommOptions::nccl_fallback on)"
        } else {
            "sum f32, f16 or bf16, or build p2p-allreduce with its cargo feature `nccl` (libnccl is then \
             loaded at run time and takes these calls)"
        },
    }
}

/// Why this build has no NCCL fallback.
#[cfg(not(feature = "nccl"))]
const NO_NCCL: &str =
    "this build of p2p-allreduce has no NCCL fallback (its cargo feature `nccl` is off)";

/// An NCCL communicator, or why there is none.
#[cfg(feature = "nccl")]
type Fallback<T> = std::result::Result<T, String>;

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
        let engine = self.engine::<T>(*op)?;
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
        let engine = self.engine::<T>(*op)?;
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
        .map_err(|e| match e {
            Error::BufferTooSmall {
                what, len, need, ..
            } => Error::BufferTooSmall {
                what,
                rank: self.rank,
                len,
                need,
            },
            e => e,
        })
    }

    /// The engine of a call, or the error of a call nobody here serves.
    fn engine<T: CommElement>(&self, op: ReduceOp) -> Result<Engine> {
        let engine = route::<T>(op);
        if let Engine::Nccl(_) = engine {
            #[cfg(feature = "nccl")]
            {
                let missing = match &self.inner {
                    Inner::Process(p) => p.nccl.as_ref().err(),
                    Inner::Threads(t) => t.nccl.as_ref().err(),
                };
                if let Some(why) = missing {
                    return Err(unserved::<T>(
                        op,
                        format!("this communicator has no NCCL fallback: {why}"),
                    ));
                }
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
                let nccl = p.nccl.as_ref().map_err(|why| {
                    unserved::<T>(op, format!("this communicator has no NCCL fallback: {why}"))
                })?;
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

#[cfg(feature = "nccl")]
fn nccl_op<T: CommElement>(op: ReduceOp) -> crate::nccl::NcclOp {
    crate::nccl::NcclOp {
        data_type: T::NCCL_TYPE,
        op: op.nccl_code(),
    }
}

/// The NCCL fallback of a `from_rank` rank: decided the same way on every
/// rank (one exchange round: can each load libnccl, and on which GPU),
/// then formed collectively. Libnccl missing on a rank or two ranks on one
/// GPU mean no fallback (said when a call needs it); an NCCL error while
/// forming it is returned.
#[cfg(feature = "nccl")]
fn process_nccl(
    ctx: &Arc<CudaContext>,
    exchange: &DirExchange,
    wanted: bool,
) -> Result<Fallback<crate::nccl::NcclRank>> {
    use crate::exchange::Exchange as _;
    if !wanted {
        return Ok(Err("CommOptions::nccl_fallback is off".into()));
    }
    let mine = match (crate::nccl::library(), driver::pci_bus_id(ctx)) {
        (Ok(_), Ok(bus)) => format!("ok {bus}"),
        (Err(e), _) | (_, Err(e)) => format!("no {e}"),
    };
    let all = exchange.all_gather(mine.as_bytes())?;
    let said: Vec<String> = all
        .iter()
        .map(|b| String::from_utf8_lossy(b).into_owned())
        .collect();
    let mut buses: Vec<&str> = Vec::new();
    for (r, s) in said.iter().enumerate() {
        match s.strip_prefix("ok ") {
            Some(bus) => {
                if let Some(other) = buses.iter().position(|b| *b == bus) {
                    return Ok(Err(format!(
                        "ranks {other} and {r} share GPU {bus} (NCCL needs one GPU per rank)"
                    )));
                }
                buses.push(bus);
            }
            None => {
                let why = s.strip_prefix("no ").unwrap_or(s);
                return Ok(Err(format!("rank {r} cannot use NCCL: {why}")));
            }
        }
    }
    crate::nccl::NcclRank::new(ctx, exchange).map(Ok)
}

/// The NCCL fallback of `from_devices` ranks (one `ncclCommInitAll`), or
/// why there is none.
#[cfg(feature = "nccl")]
fn thread_nccl(streams: &[Arc<CudaStream>], wanted: bool) -> Fallback<crate::nccl::NcclGroup> {
    if !wanted {
        return Err("CommOptions::nccl_fallback is off".into());
    }
    let devs: Vec<usize> = streams.iter().map(|s| s.context().ordinal()).collect();
    for (b, d) in devs.iter().enumerate() {
        if let Some(a) = devs[..b].iter().position(|x| x == d) {
            return Err(format!(
                "ranks {a} and {b} share GPU {d} (NCCL needs one GPU per rank)"
            ));
        }
    }
    crate::nccl::library().map_err(|e| e.to_string())?;
    crate::nccl::NcclGroup::new(streams).map_err(|e| e.to_string())
}

/// One rank's part of a `from_devices` collective.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Call {
    AllReduce {
        dtype: Dtype,
        count: usize,
        input: u64,
        output: u64,
    },
    #[cfg(feature = "nccl")]
    Nccl {
        op: crate::nccl::NcclOp,
        count: usize,
        input: u64,
        output: u64,
    },
    AddRmsNorm {
        dtype: Dtype,
        rows: usize,
        hidden: usize,
        eps_bits: u32,
        ptrs: [u64; 4],
    },
}

impl Call {
    /// The call without its pointers: what every rank must agree on.
    fn shape(&self) -> String {
        match *self {
            Call::AllReduce { dtype, count, .. } => {
                format!("all_reduce of {count} x {}", dtype.name())
            }
            #[cfg(feature = "nccl")]
            Call::Nccl { op, count, .. } => format!(
                "all_reduce of {count} elements of NCCL type {} with NCCL op {} (the NCCL fallback)",
                op.data_type, op.op
            ),
            Call::AddRmsNorm {
                dtype,
                rows,
                hidden,
                eps_bits,
                ..
            } => format!(
                "all_reduce_add_rms_norm of {rows} rows x {hidden} {} (eps {})",
                dtype.name(),
                f32::from_bits(eps_bits)
            ),
        }
    }
}

/// What the ranks of a `from_devices` communicator share.
struct Threads {
    group: PeerGroup,
    streams: Vec<Arc<CudaStream>>,
    gather: Gather<Call>,
    #[cfg(feature = "nccl")]
    nccl: Fallback<crate::nccl::NcclGroup>,
}

impl Threads {
    /// Enqueues every rank's part of one collective (`calls[r]`, rank r's),
    /// from rank `me`'s thread; one result per rank.
    fn launch(&self, calls: &[Call], me: usize) -> Vec<Result<Route>> {
        if let Some(errors) = mismatch(calls) {
            return errors;
        }
        let ptrs = |f: fn(&Call) -> u64| -> Vec<u64> { calls.iter().map(f).collect() };
        let result = match calls[0] {
            Call::AllReduce { dtype, count, .. } => {
                let input = ptrs(|c| match *c {
                    Call::AllReduce { input, .. } => input,
                    _ => 0,
                });
                let output = ptrs(|c| match *c {
                    Call::AllReduce { output, .. } => output,
                    _ => 0,
                });
                // SAFETY: every rank's thread handed in pointers valid for
                // `count` elements of `dtype` on its device (Comm's
                // contract) and waits, holding their guards, until this
                // returns.
                unsafe {
                    self.group.allreduce_raw(
                        &self.streams,
                        dtype,
                        count,
                        &input,
                        &output,
                        AlgoChoice::Auto,
                    )
                }
                .map(Route::Kernel)
            }
            #[cfg(feature = "nccl")]
            Call::Nccl { op, count, .. } => {
                let input = ptrs(|c| match *c {
                    Call::Nccl { input, .. } => input,
                    _ => 0,
                });
                let output = ptrs(|c| match *c {
                    Call::Nccl { output, .. } => output,
                    _ => 0,
                });
                match (&self.nccl, self.group.poll()) {
                    (Err(why), _) => Err(Error::Nccl(format!("no NCCL fallback: {why}"))),
                    (_, Err(e)) => Err(e),
                    (Ok(n), Ok(())) => {
                        // SAFETY: as above, for `count` elements of op's type.
                        unsafe { n.allreduce_op_raw(&self.streams, op, count, &input, &output) }
                            .map(|()| Route::Nccl)
                    }
                }
            }
            Call::AddRmsNorm {
                dtype,
                rows,
                hidden,
                eps_bits,
                ..
            } => {
                let all: Vec<[u64; 4]> = calls
                    .iter()
                    .map(|c| match *c {
                        Call::AddRmsNorm { ptrs, .. } => ptrs,
                        _ => [0; 4],
                    })
                    .collect();
                // SAFETY: every rank's pointers hold what its norm_shape
                // checked, on its device, guarded by its waiting thread;
                // `normed` overlaps no other buffer of its rank, or is its
                // (staged) input.
                unsafe {
                    self.group.allreduce_add_rmsnorm_raw(
                        &self.streams,
                        dtype,
                        rows,
                        hidden,
                        f32::from_bits(eps_bits),
                        &all,
                        AlgoChoice::Auto,
                    )
                }
                .map(Route::Kernel)
            }
        };
        share(result, calls.len(), me)
    }
}

/// Where the ranks' calls differ (beyond their pointers), every rank's
/// `CommCallMismatch`: a rank that agrees with rank 0 is told of the first
/// rank that does not, the others of rank 0. `None` where all agree.
fn mismatch(calls: &[Call]) -> Option<Vec<Result<Route>>> {
    let first = calls.first()?.shape();
    let other = calls.iter().position(|c| c.shape() != first)?;
    let other_shape = calls[other].shape();
    Some(
        calls
            .iter()
            .enumerate()
            .map(|(r, c)| {
                let (o, mine, theirs) = if c.shape() == first {
                    (other, first.clone(), other_shape.clone())
                } else {
                    (0, c.shape(), first.clone())
                };
                Err(Error::CommCallMismatch {
                    rank: r,
                    other: o,
                    mine,
                    theirs,
                })
            })
            .collect(),
    )
}

/// One collective's result for every rank: rank `me` (who enqueued it)
/// gets the error itself, the others a typed account of it.
fn share(result: Result<Route>, world: usize, me: usize) -> Vec<Result<Route>> {
    match result {
        Ok(route) => (0..world).map(|_| Ok(route)).collect(),
        Err(e) => {
            let other = |e: &Error| match e {
                // Each rank's own capture was refused alike: say so in the
                // same words, so each settles its stream the same way.
                Error::CaptureInvalidated { cause } => Error::CaptureInvalidated {
                    cause: cause.clone(),
                },
                e => Error::CommGroupCallFailed {
                    rank: me,
                    reason: e.to_string(),
                },
            };
            let mut out: Vec<Result<Route>> = (0..world).map(|_| Err(other(&e))).collect();
            out[me] = Err(e);
            out
        }
    }
}

/// The per-call meeting of a `from_devices` communicator's ranks: each
/// rank's thread leaves its call and waits; the last to come runs `launch`
/// over all the calls (in rank order) and hands every rank its result.
struct Gather<C> {
    world: usize,
    timeout: Duration,
    state: Mutex<Round<C>>,
    cv: Condvar,
}

struct Round<C> {
    calls: Vec<Option<C>>,
    results: Vec<Option<Result<Route>>>,
    /// Set when a rank gave up waiting: the ranks are out of step for good.
    broken: Option<String>,
}

impl<C: Copy> Gather<C> {
    fn new(world: usize, timeout: Duration) -> Self {
        Gather {
            world,
            timeout,
            state: Mutex::new(Round {
                calls: vec![None; world],
                results: (0..world).map(|_| None).collect(),
                broken: None,
            }),
            cv: Condvar::new(),
        }
    }

    /// Rank `rank`'s part of one collective. `launch(calls, me)` runs on the
    /// thread of the last rank to come (`me`), with every rank's call, and
    /// returns one result per rank.
    fn join(
        &self,
        rank: usize,
        call: C,
        launch: impl FnOnce(&[C], usize) -> Vec<Result<Route>>,
    ) -> Result<Route> {
        let deadline = Instant::now() + self.timeout;
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(why) = &st.broken {
            return Err(Error::Poisoned(why.clone()));
        }
        if st.calls[rank].is_some() || st.results[rank].is_some() {
            return Err(Error::Config(format!(
                "rank {rank}'s Comm is already in a collective on another thread: make each rank's \
                 calls from one thread at a time"
            )));
        }
        st.calls[rank] = Some(call);
        if st.calls.iter().all(Option::is_some) {
            let calls: Vec<C> = st.calls.iter_mut().filter_map(Option::take).collect();
            let mut results = launch(&calls, rank);
            results.resize_with(self.world, || {
                Err(Error::CommGroupCallFailed {
                    rank,
                    reason: "no result for this rank".into(),
                })
            });
            let mine = std::mem::replace(&mut results[rank], Ok(Route::Nccl));
            for (r, res) in results.into_iter().enumerate() {
                if r != rank {
                    st.results[r] = Some(res);
                }
            }
            self.cv.notify_all();
            return mine;
        }
        loop {
            if let Some(res) = st.results[rank].take() {
                return res;
            }
            if let Some(why) = st.broken.clone() {
                st.calls[rank] = None;
                return Err(Error::Poisoned(why));
            }
            let now = Instant::now();
            if now >= deadline {
                let missing: Vec<usize> =
                    (0..self.world).filter(|&r| st.calls[r].is_none()).collect();
                st.calls[rank] = None;
                st.broken = Some(format!(
                    "rank {rank} timed out after {:?} waiting for rank(s) {missing:?} to make the same call",
                    self.timeout
                ));
                self.cv.notify_all();
                return Err(Error::CommTimeout {
                    rank,
                    missing,
                    waited: self.timeout,
                });
            }
            st = self
                .cv
                .wait_timeout(st, deadline - now)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_id_names_a_fresh_private_directory_and_round_trips_through_its_bytes() {
        let a = Id::new().unwrap();
        let b = Id::new().unwrap();
        assert_ne!(a, b, "every id is a fresh directory");
        let dir = a.dir().unwrap();
        assert!(dir.is_dir(), "{dir:?}");
        assert!(dir.starts_with(std::env::temp_dir()), "{dir:?}");
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(&dir).unwrap().permissions().mode();
            assert_eq!(mode & 0o777, 0o700, "{mode:o}");
        }
        // As an engine passes it: internal() -> another rank -> uninit().
        let back = Id::uninit(*a.internal());
        assert_eq!(back, a);
        assert_eq!(back.dir().unwrap(), dir);
        // And through a file of bytes (mistral.rs's shape).
        let file = dir.join("id");
        std::fs::write(&file, a.to_bytes()).unwrap();
        let read: [u8; ID_BYTES] = std::fs::read(&file).unwrap().try_into().unwrap();
        assert_eq!(Id::from_bytes(read).dir().unwrap(), dir);
        assert!(format!("{a:?}").contains(&*dir.to_string_lossy()));
        for d in [a.dir().unwrap(), b.dir().unwrap()] {
            let _ = std::fs::remove_dir_all(d);
        }
    }

    #[test]
    fn an_id_holds_a_path_of_up_to_its_room_and_refuses_a_longer_or_relative_one() {
        let longest = format!("/{}", "d".repeat(ID_MAX_PATH - 1));
        let id = Id::for_dir(Path::new(&longest)).unwrap();
        assert_eq!(id.dir().unwrap(), PathBuf::from(&longest));
        let too_long = format!("/{}", "d".repeat(ID_MAX_PATH));
        assert!(matches!(
            Id::for_dir(Path::new(&too_long)),
            Err(Error::CommId { reason }) if reason.contains("TMPDIR")
        ));
        assert!(matches!(
            Id::for_dir(Path::new("relative/dir")),
            Err(Error::CommId { .. })
        ));
    }

    #[test]
    fn bytes_that_are_not_an_id_are_a_typed_error() {
        let good = Id::for_dir(Path::new("/tmp/x")).unwrap().to_bytes();
        // An NCCL id (random bytes), all zeros, a bad length, junk after the
        // path, a relative path.
        let mut nccl = [0u8; ID_BYTES];
        for (i, b) in nccl.iter_mut().enumerate() {
            *b = (i as u8).wrapping_mul(37).wrapping_add(11);
        }
        let mut bad_len = good;
        bad_len[8] = (ID_MAX_PATH + 1) as u8;
        let mut zero_len = good;
        zero_len[8] = 0;
        let mut junk = good;
        junk[ID_BYTES - 1] = 1;
        let mut relative = good;
        relative[9] = b'x';
        for (what, b) in [
            ("nccl", nccl),
            ("zeros", [0; ID_BYTES]),
            ("length", bad_len),
            ("empty", zero_len),
            ("junk", junk),
            ("relative", relative),
        ] {
            let e = Id::from_bytes(b).dir().unwrap_err();
            assert!(matches!(e, Error::CommId { .. }), "{what}: {e:?}");
            assert!(e.to_string().contains("Id::new()"), "{what}: {e}");
        }
        assert!(format!("{:?}", Id::from_bytes(nccl)).contains("not an id"));
    }

    #[test]
    fn sums_of_kernel_types_go_to_the_kernels_and_the_rest_to_nccl() {
        assert_eq!(route::<f32>(ReduceOp::Sum), Engine::Kernels(Dtype::F32));
        assert_eq!(
            route::<half::f16>(ReduceOp::Sum),
            Engine::Kernels(Dtype::F16)
        );
        assert_eq!(
            route::<half::bf16>(ReduceOp::Sum),
            Engine::Kernels(Dtype::Bf16)
        );
        for op in [ReduceOp::Prod, ReduceOp::Max, ReduceOp::Min, ReduceOp::Avg] {
            assert_eq!(route::<half::bf16>(op), Engine::Nccl(Unserved::Op(op)));
            assert_eq!(route::<i32>(op), Engine::Nccl(Unserved::Op(op)));
        }
        assert_eq!(
            route::<f64>(ReduceOp::Sum),
            Engine::Nccl(Unserved::Type("f64"))
        );
        assert_eq!(
            route::<u8>(ReduceOp::Sum),
            Engine::Nccl(Unserved::Type("u8"))
        );
    }

    #[test]
    fn element_and_op_codes_are_those_of_nccl_h() {
        let types = [
            (i8::NCCL_TYPE, 0),
            (u8::NCCL_TYPE, 1),
            (i32::NCCL_TYPE, 2),
            (u32::NCCL_TYPE, 3),
            (i64::NCCL_TYPE, 4),
            (u64::NCCL_TYPE, 5),
            (half::f16::NCCL_TYPE, 6),
            (f32::NCCL_TYPE, 7),
            (f64::NCCL_TYPE, 8),
            (half::bf16::NCCL_TYPE, 9),
        ];
        for (got, want) in types {
            assert_eq!(got, want);
        }
        let ops = [
            ReduceOp::Sum,
            ReduceOp::Prod,
            ReduceOp::Max,
            ReduceOp::Min,
            ReduceOp::Avg,
        ];
        let codes: Vec<i32> = ops.iter().map(|o| o.nccl_code()).collect();
        assert_eq!(codes, vec![0, 1, 2, 3, 4]);
    }

    #[test]
    fn an_unserved_call_names_the_call_why_and_what_to_do() {
        let e = unserved::<half::bf16>(ReduceOp::Max, "because".into());
        let s = e.to_string();
        assert!(s.contains("ReduceOp::Max over bf16"), "{s}");
        assert!(s.contains("because"), "{s}");
        // Without the feature the fix is the feature; with it, NCCL itself.
        if cfg!(feature = "nccl") {
            assert!(s.contains("make the NCCL fallback available"), "{s}");
        } else {
            assert!(s.contains("cargo feature `nccl`"), "{s}");
        }
        let e = unserved::<f64>(ReduceOp::Sum, "x".into());
        assert!(e.to_string().contains("ReduceOp::Sum over f64"), "{e}");
        #[cfg(not(feature = "nccl"))]
        assert!(NO_NCCL.contains("feature `nccl` is off"));
    }

    /// Engines move each rank's communicator into its thread and share
    /// it (mistral.rs keeps an `Arc<Comm>` in its ops).
    #[test]
    fn a_communicator_is_send_and_sync() {
        fn send_sync<T: Send + Sync>() {}
        send_sync::<Comm>();
        send_sync::<Id>();
    }

    #[test]
    fn a_communicator_of_no_ranks_is_refused_before_any_cuda_call() {
        assert!(matches!(
            Comm::from_devices(Vec::new()),
            Err(Error::WorldSize(0))
        ));
    }

    /// Runs one thread per call through one gather round, rank r passing
    /// `calls[r]`, the ranks arriving in reverse order.
    fn round(
        g: &Gather<u32>,
        calls: &[u32],
        launch: fn(&[u32], usize) -> Vec<Result<Route>>,
    ) -> Vec<Result<Route>> {
        std::thread::scope(|s| {
            let hs: Vec<_> = calls
                .iter()
                .enumerate()
                .map(|(r, &c)| {
                    s.spawn(move || {
                        // Arrive in reverse rank order, so the launching
                        // thread is rank 0's, not the first spawned.
                        std::thread::sleep(Duration::from_millis(5 * (calls.len() - r) as u64));
                        g.join(r, c, launch)
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    #[test]
    fn the_last_rank_to_come_launches_every_ranks_call_in_rank_order() {
        let g = Gather::new(3, Duration::from_secs(10));
        fn launch(calls: &[u32], me: usize) -> Vec<Result<Route>> {
            assert_eq!(calls, &[10, 11, 12], "rank order");
            assert_eq!(me, 0, "rank 0 came last");
            // A distinct result per rank, to see each gets its own.
            calls
                .iter()
                .map(|&c| {
                    Ok(if c == 11 {
                        Route::Nccl
                    } else {
                        Route::Kernel(crate::Algorithm::OneStage)
                    })
                })
                .collect()
        }
        for _ in 0..3 {
            let got = round(&g, &[10, 11, 12], launch);
            assert!(matches!(got[0], Ok(Route::Kernel(_))));
            assert!(matches!(got[1], Ok(Route::Nccl)));
            assert!(matches!(got[2], Ok(Route::Kernel(_))));
        }
    }

    #[test]
    fn a_rank_in_two_calls_at_once_is_refused() {
        let g = Gather::new(2, Duration::from_secs(10));
        std::thread::scope(|s| {
            let first = s.spawn(|| g.join(0, 1u32, |_, me| share(Ok(Route::Nccl), 2, me)));
            // Wait until rank 0's first call is there, then call again as
            // rank 0 from this thread.
            while g.state.lock().unwrap().calls[0].is_none() {
                std::thread::yield_now();
            }
            let again = g.join(0, 2u32, |_, _| panic!("never launched"));
            assert!(
                matches!(&again, Err(Error::Config(m)) if m.contains("already in a collective"))
            );
            // Rank 1 completes the first call.
            let one = g.join(1, 1u32, |calls, me| {
                assert_eq!(calls, &[1, 1]);
                share(Ok(Route::Nccl), 2, me)
            });
            assert!(matches!(one, Ok(Route::Nccl)));
            assert!(matches!(first.join().unwrap(), Ok(Route::Nccl)));
        });
    }

    #[test]
    fn a_failed_launch_reaches_every_rank_typed() {
        let g = Gather::new(2, Duration::from_secs(10));
        fn launch(_: &[u32], me: usize) -> Vec<Result<Route>> {
            share(Err(Error::NoDriver), 2, me)
        }
        let got = round(&g, &[1, 1], launch);
        assert!(matches!(got[0], Err(Error::NoDriver)), "{:?}", got[0]);
        match &got[1] {
            Err(Error::CommGroupCallFailed { rank: 0, reason }) => {
                assert!(reason.contains("no CUDA driver"), "{reason}")
            }
            other => panic!("{other:?}"),
        }
        // A refused capture is each rank's own error, in the same words.
        let shared = share(
            Err(Error::CaptureInvalidated {
                cause: "isolation".into(),
            }),
            3,
            2,
        );
        for r in shared {
            assert!(matches!(r, Err(Error::CaptureInvalidated { cause }) if cause == "isolation"));
        }
    }

    #[test]
    fn a_rank_that_never_calls_times_out_the_others_and_the_comm_stays_broken() {
        let g = Gather::new(3, Duration::from_millis(100));
        let t0 = Instant::now();
        let got: Vec<Result<Route>> = std::thread::scope(|s| {
            let hs: Vec<_> = [0usize, 2]
                .into_iter()
                .map(|r| {
                    let g = &g;
                    s.spawn(move || g.join(r, 0u32, |_, _| panic!("never launched")))
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert!(t0.elapsed() < Duration::from_secs(5));
        let mut timed_out = 0;
        for r in &got {
            match r {
                Err(Error::CommTimeout { missing, .. }) => {
                    assert!(missing.contains(&1), "{missing:?}");
                    timed_out += 1;
                }
                Err(Error::Poisoned(why)) => assert!(why.contains("timed out"), "{why}"),
                other => panic!("{other:?}"),
            }
        }
        assert!(timed_out >= 1);
        // The late rank, and every later call, is refused at once.
        let late = g.join(1, 0u32, |_, _| panic!("never launched"));
        assert!(matches!(late, Err(Error::Poisoned(_))), "{late:?}");
    }

    #[test]
    fn calls_that_differ_between_ranks_are_a_mismatch_on_every_rank() {
        let a = Call::AllReduce {
            dtype: Dtype::Bf16,
            count: 4096,
            input: 0x1000,
            output: 0x2000,
        };
        // Pointers differ between ranks: not a mismatch.
        let a2 = Call::AllReduce {
            dtype: Dtype::Bf16,
            count: 4096,
            input: 0x9000,
            output: 0x9000,
        };
        assert_eq!(a.shape(), a2.shape());
        let b = Call::AllReduce {
            dtype: Dtype::Bf16,
            count: 4097,
            input: 0x1000,
            output: 0x2000,
        };
        let n = Call::AddRmsNorm {
            dtype: Dtype::Bf16,
            rows: 1,
            hidden: 4096,
            eps_bits: 1e-6f32.to_bits(),
            ptrs: [0x1000, 0x2000, 0x3000, 0x4000],
        };
        assert_ne!(a.shape(), b.shape());
        assert_ne!(a.shape(), n.shape());
        assert!(n.shape().contains("1 rows x 4096 bf16"), "{}", n.shape());
        assert!(mismatch(&[a, a2, a]).is_none());
        // Rank 2 asks for one element more: every rank hears of it.
        let got = mismatch(&[a, a2, b]).expect("a mismatch");
        for (r, g) in got.iter().enumerate() {
            match g {
                Err(Error::CommCallMismatch {
                    rank,
                    other,
                    mine,
                    theirs,
                }) => {
                    assert_eq!(*rank, r);
                    let want_other = if r == 2 { 0 } else { 2 };
                    assert_eq!(*other, want_other, "rank {r}");
                    let (m, t) = if r == 2 {
                        ("4097", "4096")
                    } else {
                        ("4096", "4097")
                    };
                    assert!(
                        mine.contains(m) && theirs.contains(t),
                        "rank {r}: {mine} / {theirs}"
                    );
                }
                other => panic!("rank {r}: {other:?}"),
            }
        }
        // A fused call against a plain one.
        let got = mismatch(&[n, a]).expect("a mismatch");
        assert!(
            matches!(&got[1], Err(Error::CommCallMismatch { mine, .. }) if mine.starts_with("all_reduce of"))
        );
    }
}
