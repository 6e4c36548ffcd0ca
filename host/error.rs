//! Every error a caller can cause or meet, with what to do about it.

use crate::abi::{BarrierKind, Dtype, MAX_RANKS};
use cudarc::driver::DriverError;

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(
        "no CUDA driver found (libcuda could not be loaded): install the NVIDIA driver, or run on a \
         machine with a GPU; the PTX part of this crate works without one"
    )]
    NoDriver,

    #[error(
        "no PTX in this build runs on compute capability {major}.{minor}: built for {built:?}; rebuild with \
         P2P_ALLREDUCE_ARCHS including sm_{major}{minor}"
    )]
    NoPtxForDevice {
        major: u32,
        minor: u32,
        built: Vec<&'static str>,
    },

    #[error("world size {0} is not supported: use 1..={MAX_RANKS} ranks")]
    WorldSize(usize),

    #[error("got {got} {what} for a group of {world} ranks: pass exactly one per rank")]
    RankCount {
        what: &'static str,
        got: usize,
        world: usize,
    },

    #[error(
        "rank mismatch: rank {rank} has {dtype:?} x {count} but rank 0 has {dtype0:?} x {count0}; every rank \
         must pass the same dtype and element count to the same collective"
    )]
    RankMismatch {
        rank: usize,
        dtype: Dtype,
        count: usize,
        dtype0: Dtype,
        count0: usize,
    },

    #[error(
        "{what} of rank {rank} at {ptr:#x} is not {align}-byte aligned: pass a buffer from cuMemAlloc (or an \
         offset that is a multiple of {align} bytes), or use the staged path which copies it"
    )]
    Misaligned {
        what: &'static str,
        rank: usize,
        ptr: u64,
        align: usize,
    },

    #[error("{what} of rank {rank} holds {len} elements but the collective needs {need}: pass a larger buffer")]
    BufferTooSmall {
        what: &'static str,
        rank: usize,
        len: usize,
        need: usize,
    },

    #[error(
        "message of {bytes} bytes is larger than this group's {capacity}-byte buffers and chunking was turned \
         off: enable chunking or create the group with Config::max_bytes >= {bytes}"
    )]
    MessageTooLarge { bytes: usize, capacity: usize },

    #[error(
        "rank {rank}, block {block}: peer {peer} did not arrive at the {barrier:?} barrier (epoch {epoch}) \
         within the timeout; that rank is dead, late, or ran a different collective. The group is now out of \
         step: call reset() on every rank (or recreate the group) before the next collective"
    )]
    PeerTimeout {
        rank: usize,
        block: u32,
        peer: u32,
        barrier: BarrierKind,
        epoch: u32,
    },

    #[error(
        "rank {rank}, block {block}: peer {peer} made another call than this rank in the same collective \
         (epoch {epoch}): this rank's is {mine}, the peer's {theirs}. Every rank must make the same calls \
         (count, dtype, algorithm, fused shape) in the same order. The group is now out of step: call reset() \
         on every rank (or recreate the group) before the next collective"
    )]
    CallMismatch {
        rank: usize,
        block: u32,
        peer: u32,
        epoch: u32,
        /// This rank's call, as its words carried it.
        mine: crate::call_tag::TaggedCall,
        /// The peer's, as its words left in this rank's signal show it.
        theirs: crate::call_tag::TaggedCall,
    },

    #[error("kernel on rank {rank} reported a bad launch shape (block {block}): this is a bug in p2p-allreduce")]
    BadLaunch { rank: usize, block: u32 },

    #[error(
        "rank {rank}: a CUDA graph ran an allreduce whose captured buffers were never registered: call \
         register_captured() on every rank after capture and before the first launch"
    )]
    Unregistered { rank: usize },

    #[error("kernel on rank {rank} wrote an unknown error record {code}; the signal buffer may be corrupted")]
    UnknownKernelError { rank: usize, code: u32 },

    #[error(
        "a grid of {blocks} blocks x {threads} threads cannot be co-resident on this GPU (room for {capacity}); \
         all virtual ranks must run at once or their barriers would wait forever: use fewer blocks \
         (Config::max_blocks) or fewer ranks"
    )]
    NotCoResident {
        blocks: u32,
        threads: u32,
        capacity: u32,
    },

    #[error(
        "GPU {a} cannot access GPU {b} as a peer (no P2P path): these two GPUs cannot form a group"
    )]
    NoPeerAccess { a: usize, b: usize },

    #[error("the group is poisoned by an earlier error ({0}); call reset() or recreate it")]
    Poisoned(String),

    #[error(
        "rank {rank}: pointer {ptr:#x} lies in no buffer registered with register_buffer: register the buffer \
         on every rank first, or use the staged allreduce"
    )]
    NotRegistered { rank: usize, ptr: u64 },

    #[error(
        "these registered buffers belong to another group (their tables name that group's scratch and \
         signals): allocate them with alloc_registered on the group that runs the allreduce"
    )]
    ForeignRegistered,

    #[error(
        "two-stage over registered buffers needs {bytes} bytes of scratch per rank but this group has \
         {capacity}: use AlgoChoice::Auto or OneStage (same bits), or a group with Config::max_bytes >= {bytes}"
    )]
    ScratchTooSmall { bytes: usize, capacity: usize },

    #[error(
        "the stream given for rank {rank} belongs to GPU {stream_device}, but rank {rank} lives on GPU \
         {rank_device}: pass streams[r] created on rank r's device (its context)"
    )]
    StreamDevice {
        rank: usize,
        stream_device: usize,
        rank_device: usize,
    },

    #[error(
        "this group's previous call ran on another stream and one of the two streams is capturing a CUDA \
         graph, where the group cannot order the calls: use one stream per rank for a group (the capture \
         stream), or call check() on the previous stream before switching"
    )]
    StreamSwitchInCapture,

    #[error(
        "a {} allreduce of {bytes} bytes over zero-copy inputs does not fit its landing zone ({capacity} \
         bytes of message): use AlgoChoice::Auto, or OneStage (same bits), or a group with Config::{setting} \
         >= {bytes}",
        algorithm.name()
    )]
    ZoneTooSmall {
        algorithm: crate::abi::Algorithm,
        bytes: usize,
        capacity: usize,
        /// The `Config` field that sizes this landing zone
        /// ([`crate::config::zone_setting`]).
        setting: &'static str,
    },

    #[error("fused allreduce + RMSNorm: {0}")]
    NormShape(String),

    #[error(
        "the fused allreduce + RMSNorm runs one_stage, two_stage or push_ll, not {}: use AlgoChoice::Auto, \
         OneStage, TwoStage or PushLl",
        .0.name()
    )]
    NormAlgorithm(crate::abi::Algorithm),

    #[error(
        "the fused push_ll kernel takes rows of whole {chunk}-element chunks, at most {max_hidden} \
         {} elements with {threads} threads per block; hidden size {hidden} is not: use \
         AlgoChoice::Auto (one_stage or two_stage serve it) or OneStage/TwoStage",
        .dtype.name(),
        chunk = crate::abi::NORM_CHUNK
    )]
    NormPushLlShape {
        dtype: crate::abi::Dtype,
        hidden: usize,
        max_hidden: usize,
        threads: u32,
    },

    #[error(
        "thresholds file {path}: {reason}. Fix or delete it, run `p2p-allreduce tune` again, or set \
         P2P_ALLREDUCE_THRESHOLDS=none to use the built-in table"
    )]
    ThresholdsFile {
        path: std::path::PathBuf,
        reason: String,
    },

    #[error(
        "ranks {a} and {b} were given the same stream: each rank needs its own stream (ranks that share a \
         GPU run concurrently and wait for each other at barriers)"
    )]
    SharedStream { a: usize, b: usize },

    #[error("rendezvous failed: {0}")]
    Rendezvous(String),

    #[error(
        "ranks {missing:?} did not join the exchange within {waited:?}: start every rank with the same world \
         size and rendezvous, or raise the timeout"
    )]
    RendezvousTimeout {
        missing: Vec<usize>,
        waited: std::time::Duration,
    },

    #[error("rank {rank} disagrees with rank {other} about the group: {what}; start every rank with the same settings")]
    GroupMismatch {
        rank: usize,
        other: usize,
        what: String,
    },

    // --- Issue 31: one host per group, the rendezvous directory, capture
    // under cudarc's event tracking, registered buffers' ranks.
    #[error(
        "rank {rank} runs on host {host} but rank {peer} on host {peer_host}: a group shares GPU memory \
         through CUDA IPC, which works only between processes of one host (one running kernel, one boot \
         id). Use NCCL (or your engine's allreduce) across hosts, and p2p-allreduce within each host"
    )]
    CrossHost {
        rank: usize,
        host: String,
        peer: usize,
        peer_host: String,
    },

    #[error(
        "rank {peer} could not set up its part of the group ({step}): {reason}. Every rank stops here \
         instead of waiting for it: fix that rank (its own error says more), or use NCCL"
    )]
    PeerSetupFailed {
        rank: usize,
        peer: usize,
        step: &'static str,
        reason: String,
    },

    #[error(
        "rank {rank}'s record did not arrive within {waited:?}: {path} holds {reason}. That is a record of \
         an earlier run, not of this one: start rank {rank}, or use a fresh rendezvous directory per group \
         (or delete the old records)"
    )]
    StaleRecord {
        rank: usize,
        path: std::path::PathBuf,
        reason: String,
        waited: std::time::Duration,
    },

    #[error(
        "rank {rank} (process {pid}) exited during the rendezvous: start the group again on every rank, \
         in a fresh rendezvous directory"
    )]
    PeerExited { rank: usize, pid: u32 },

    #[error(
        "the graph capture on this stream was invalidated before this call could be captured ({cause}). \
         With cudarc's event tracking on (its default), using a CudaSlice or view inside a capture makes \
         cudarc wait for an event recorded before the capture, which CUDA refuses \
         (CUDA_ERROR_STREAM_CAPTURE_ISOLATION): call CudaContext::disable_event_tracking() before allocating \
         the buffers you capture, or pass raw device pointers (the _raw calls); then capture again"
    )]
    CaptureInvalidated { cause: String },

    // --- Issue 48: a host shared with other users.
    #[error(
        "{what} {path} {reason}: whoever can write there can hand this group records that aim its kernels \
         at memory that is not a peer's buffer, so nothing in it was read. Use a rendezvous directory that \
         only this user owns and can write (mode 0700, not a symbolic link), e.g. a fresh one from \
         `mktemp -d` or under $XDG_RUNTIME_DIR, on every rank"
    )]
    UnsafeRendezvous {
        /// "the rendezvous directory", or whose record file.
        what: String,
        path: std::path::PathBuf,
        reason: String,
    },

    #[error(
        "rank {rank}: rank {peer}'s {what} claims {bytes} bytes at offset {offset}, but the allocation its CUDA \
         IPC handle maps here holds {mapped} bytes from there on: a corrupted or forged record, or a peer of \
         another build. Nothing was launched on it: start every rank from the same build with the same \
         Config, in a private rendezvous directory"
    )]
    PeerBufferTooSmall {
        rank: usize,
        peer: usize,
        what: &'static str,
        offset: u64,
        bytes: u64,
        /// Bytes of the peer's allocation as mapped here, from the address
        /// `cuIpcOpenMemHandle` returned to the allocation's end.
        mapped: u64,
    },

    #[error("rank {rank} is outside the {ranks} ranks of these registered buffers: use ranks 0..{ranks}")]
    RankOutOfRange { rank: usize, ranks: usize },

    #[error("NCCL: {0}")]
    Nccl(String),

    // --- Issue 45: the NCCL-shaped communicator (`crate::comm`).
    #[error(
        "comm::Comm cannot run {what} with p2p-allreduce's kernels (they sum f32, f16 and bf16), and {why}: \
         {fix}"
    )]
    CommUnserved {
        /// The call, e.g. "ReduceOp::Max over f32" or "ReduceOp::Sum over f64".
        what: String,
        /// Why NCCL does not take it instead.
        why: String,
        /// What to do.
        fix: &'static str,
    },

    #[error(
        "this 128-byte id is not a comm::Id made by p2p-allreduce ({reason}): make it with comm::Id::new() on \
         one rank and pass its internal() bytes unchanged to every rank (an NCCL ncclUniqueId is not one)"
    )]
    CommId { reason: String },

    #[error(
        "rank {rank} waited {waited:?} for rank(s) {missing:?} to make the same call on their comm::Comm: every \
         rank's thread must make the same calls in the same order. This communicator is now unusable: create \
         it again (Comm::from_devices) on every rank"
    )]
    CommTimeout {
        rank: usize,
        missing: Vec<usize>,
        waited: std::time::Duration,
    },

    #[error(
        "rank {rank}'s thread made {mine} but rank {other}'s made {theirs} as the same collective: every rank must \
         make the same calls (kind, dtype, count, shape, op) in the same order"
    )]
    CommCallMismatch {
        rank: usize,
        other: usize,
        mine: String,
        theirs: String,
    },

    #[error("rank {rank} enqueued this collective for every rank of the communicator, and it failed: {reason}")]
    CommGroupCallFailed { rank: usize, reason: String },

    #[error("invalid configuration: {0}")]
    Config(String),

    #[error("CUDA driver error in {during}: {source}")]
    Driver {
        during: &'static str,
        source: DriverError,
    },
}

impl Error {
    /// The error with the rank of a `BufferTooSmall` set to `rank`: the
    /// checks of one rank's buffers count from 0, the caller knows which
    /// rank of the group they were.
    pub(crate) fn at_rank(self, rank: usize) -> Error {
        match self {
            Error::BufferTooSmall {
                what, len, need, ..
            } => Error::BufferTooSmall {
                what,
                rank,
                len,
                need,
            },
            e => e,
        }
    }
}

/// Attaches what we were doing to a driver error.
pub trait Context<T> {
    fn during(self, what: &'static str) -> Result<T>;
}

impl<T> Context<T> for std::result::Result<T, DriverError> {
    fn during(self, what: &'static str) -> Result<T> {
        self.map_err(|source| Error::Driver {
            during: what,
            source,
        })
    }
}
