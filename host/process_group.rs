//! [`ProcessGroup`]: one process per rank, buffers shared through CUDA IPC
//! handles (see [`crate::ipc`]); each rank launches the real-rank kernel
//! entries on its own stream, like a [`crate::PeerGroup`] rank.

use crate::abi::{Algorithm, Dtype, MAX_RANKS};
use crate::checks::{check_world, count_of};
use crate::collective::{settle, Collective, Member, RankBuffers};
use crate::driver::{self, DeviceAlloc, IpcMapping, Kernels};
use crate::element::DeviceElement;
use crate::error::{Error, Result};
use crate::exchange::{agree_setup, Exchange};
use crate::fused::{norm_shape, NormInputs, NormPtrs};
use crate::ipc;
use crate::launch::{Faults, Ranks};
use crate::peer_tables::PeerTables;
use crate::plan::{AlgoChoice, Config, Link};
use crate::thresholds::{self, Backend, Mode, Thresholds};
use cudarc::driver::{CudaContext, CudaStream, DevicePtr, DevicePtrMut};
use std::sync::{Arc, Mutex};

pub use crate::peer_tables::TABLE_SLOTS;

/// This process's rank of a group formed over CUDA IPC.
///
/// Calls are ordered on the stream they are given; calls on different
/// streams are ordered after each other by the group. Kernel errors (a peer
/// timeout) are reported by [`ProcessGroup::check`], and every later call
/// refuses to run (a kernel raises a host mailbox, so this needs no device
/// sync: see [`ProcessGroup::poll`]).
///
/// ```no_run
/// use p2p_allreduce::{driver, AlgoChoice, Config, DirExchange, ProcessGroup};
/// use std::time::Duration;
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let (rank, world) = (0, 2); // e.g. from the launcher's environment
/// let ctx = driver::open_device(rank)?;
/// let stream = ctx.new_stream()?;
/// // A directory private to this user (e.g. made by `mktemp -d` in the
/// // launcher and passed to every rank): DirExchange refuses any other.
/// let dir = std::env::var("MY_JOB_RENDEZVOUS_DIR")?;
/// let ex = DirExchange::new(dir.as_ref(), rank, world, Duration::from_secs(60))?;
/// let group = ProcessGroup::new(&ctx, &ex, Config::default())?;
/// let input = stream.clone_htod(&vec![half::bf16::ONE; 4096])?;
/// let mut output = stream.alloc_zeros::<half::bf16>(4096)?;
/// group.allreduce(&stream, &input, &mut output, AlgoChoice::Auto)?;
/// group.check(&stream)?;
/// # Ok(()) }
/// ```
pub struct ProcessGroup {
    rank: usize,
    core: Collective,
    ctx: Arc<CudaContext>,
    _opened: Vec<IpcMapping>,
    /// Zero-copy tables: captured allreduces and registered buffers.
    tables: Mutex<PeerTables>,
}

impl std::fmt::Debug for ProcessGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProcessGroup")
            .field("rank", &self.rank)
            .field("world", &self.core.world)
            .field("device", &self.ctx.ordinal())
            .field("link", &self.core.link)
            .field("config", &self.core.config)
            .finish()
    }
}

pub use crate::ipc::Forgery;

/// Every rank must pick the same algorithm for the same call, so every
/// rank must use the same `Auto` table (a thresholds file present on one
/// machine only, or a different `P2P_ALLREDUCE_THRESHOLDS`, would break
/// that).
fn agree_on_thresholds(
    exchange: &dyn Exchange,
    thresholds: &Thresholds,
    link: Link,
    world: usize,
) -> Result<()> {
    let mine = thresholds.fingerprint(link, world);
    let all = exchange.all_gather(&mine)?;
    match all.iter().position(|f| *f != mine) {
        None => Ok(()),
        Some(other) => Err(Error::GroupMismatch {
            rank: exchange.rank(),
            other,
            what: format!(
                "Auto's table for {world} ranks over {} differs (this rank's comes from {:?}); \
                 give every rank the same thresholds file (P2P_ALLREDUCE_THRESHOLDS) or the same Config::thresholds",
                thresholds::link_label(link),
                thresholds.origin()
            ),
        }),
    }
}

impl ProcessGroup {
    /// Forms rank `exchange.rank()` of a group of `exchange.world()` processes.
    /// Every rank must pass the same `config`; a mismatch is reported.
    ///
    /// Three rounds of `exchange`: the ranks' identities
    /// ([`crate::ipc::introduce`]: a group across hosts is refused with
    /// `Error::CrossHost`, one across builds with `GroupMismatch`, both
    /// before any CUDA call), the buffers' IPC records, and `Auto`'s table.
    ///
    /// Every peer buffer mapped from a CUDA IPC handle is checked to be as
    /// large as `config` needs (`Error::PeerBufferTooSmall` on every rank
    /// otherwise, before any kernel runs).
    pub fn new(ctx: &Arc<CudaContext>, exchange: &dyn Exchange, config: Config) -> Result<Self> {
        Self::create(ctx, exchange, config, Forgery::default())
    }

    /// [`ProcessGroup::new`] as a broken or hostile peer would run it: its
    /// staging allocation and zero-copy records as `forgery` says. For the
    /// tests of the peers' checks (a GPU case of issue 48); never use it
    /// otherwise.
    #[cfg(feature = "testkit")]
    #[doc(hidden)]
    pub fn new_forged(
        ctx: &Arc<CudaContext>,
        exchange: &dyn Exchange,
        config: Config,
        forgery: Forgery,
    ) -> Result<Self> {
        Self::create(ctx, exchange, config, forgery)
    }

    fn create(
        ctx: &Arc<CudaContext>,
        exchange: &dyn Exchange,
        config: Config,
        forgery: Forgery,
    ) -> Result<Self> {
        let (rank, world) = (exchange.rank(), exchange.world());
        check_world(world)?;
        config.validate().map_err(Error::Config)?;
        // Who the ranks are (build, host, process), before any CUDA call:
        // a group across hosts or builds is refused here.
        ipc::introduce(exchange)?;
        // Local steps that can fail on one rank alone: each is followed by a
        // round in which every rank says how it went, so a rank that failed
        // never leaves its peers waiting in the next exchange.
        let local = (|| {
            let kernels = Kernels::for_context(ctx, config.kernel_image)?;
            kernels.prepare(world, false, config.threads_per_block)?;
            let mut own = RankBuffers::new(ctx, &config, world)?;
            if let Some(bytes) = forgery.staging_bytes {
                own.staging = DeviceAlloc::zeroed(ctx, bytes)?;
            }
            Ok((kernels, own))
        })();
        let (kernels, own) = agree_setup(exchange, "kernels and buffers", local)?;
        let records = ipc::publish(ctx, exchange, &config, &own)?;
        // Mapping the peers' buffers (each checked to be as large as the
        // settings need) can fail on one rank alone: the round after it
        // says so to every rank.
        let local = ipc::open_peers(ctx, &config, &own, &records).and_then(|rv| {
            let t = crate::machine::resolve_thresholds(&config.thresholds, ctx, rv.link, world)?;
            Ok((rv, t))
        });
        let (rv, thresholds) = agree_setup(exchange, "the peers' buffers and Auto's table", local)?;
        agree_on_thresholds(exchange, &thresholds, rv.link, world)?;
        let config = Config {
            thresholds,
            ..config
        };
        let mut staging = [0u64; MAX_RANKS];
        staging[rank] = own.staging.ptr();
        let member = Member::new(
            kernels,
            Ranks::One(rank),
            staging,
            DeviceAlloc::from_value(ctx, &rv.table)?,
        )?;
        let tables = PeerTables::new(ctx, rank, world, rv.table, forgery)?;
        Ok(ProcessGroup {
            rank,
            core: Collective::new(
                world,
                config,
                rv.link,
                rv.signals,
                vec![member],
                vec![(rank, own)],
            ),
            ctx: ctx.clone(),
            _opened: rv.opened,
            tables: Mutex::new(tables),
        })
    }

    pub fn rank(&self) -> usize {
        self.rank
    }
    pub fn world(&self) -> usize {
        self.core.world
    }
    /// The link to the slowest peer (as `PeerGroup::link`).
    pub fn link(&self) -> Link {
        self.core.link
    }
    pub fn config(&self) -> &Config {
        &self.core.config
    }

    /// Who the table gives `count` elements of `dtype` to in `mode`
    /// ([`crate::thresholds::route`]): a pure function of the group's
    /// table (the same on every rank), the size, the type and the mode.
    pub fn route(&self, count: usize, dtype: Dtype, mode: Mode) -> Backend {
        self.core
            .config
            .route(self.core.link, self.core.world, count, dtype, mode)
    }

    /// Whether the table measured NCCL faster than our kernels for `count`
    /// elements of `dtype` (by more than
    /// [`crate::thresholds::NCCL_MUST_WIN_BY`]): an embedder with its own
    /// NCCL communicator sends such calls there, unless it needs our bits
    /// ([`Mode::Deterministic`]). False with the built-in table.
    pub fn nccl_wins(&self, count: usize, dtype: Dtype) -> bool {
        self.route(count, dtype, Mode::Fastest).is_nccl()
    }

    /// Staged allreduce of this rank's `input` (a slice or view) into
    /// `output`, on `stream`. Every rank must call it with the same dtype
    /// and length. Returns the algorithm of the whole call; messages above
    /// `Config::max_bytes` run in chunks.
    ///
    /// Kernel errors (a peer that never arrives) show later: [`Self::poll`]
    /// (no wait) and [`Self::check`] report them, and the next call refuses
    /// to run until `reset`.
    pub fn allreduce<T, I, O>(
        &self,
        stream: &Arc<CudaStream>,
        input: &I,
        output: &mut O,
        algo: AlgoChoice,
    ) -> Result<Algorithm>
    where
        T: DeviceElement,
        I: DevicePtr<T>,
        O: DevicePtrMut<T>,
    {
        let count = count_of(
            T::DTYPE,
            std::iter::once(input.len()),
            std::iter::once(output.len()),
        )
        .map_err(|e| e.at_rank(self.rank))?;
        let (inp, gi) = input.device_ptr(stream);
        let (out, go) = output.device_ptr_mut(stream);
        // SAFETY: both are live, hold >= count elements and are guarded
        // until the work is enqueued on `stream`.
        let r = unsafe { self.allreduce_raw(stream, T::DTYPE, count, inp, out, algo) };
        settle(r, (gi, go), &[stream])
    }

    /// In-place allreduce of this rank's `buffer`.
    ///
    /// Kernel errors (a peer that never arrives) show later: [`Self::poll`]
    /// (no wait) and [`Self::check`] report them, and the next call refuses
    /// to run until `reset`.
    pub fn allreduce_in_place<T, B>(
        &self,
        stream: &Arc<CudaStream>,
        buffer: &mut B,
        algo: AlgoChoice,
    ) -> Result<Algorithm>
    where
        T: DeviceElement,
        B: DevicePtrMut<T>,
    {
        let count = buffer.len();
        let (p, g) = buffer.device_ptr_mut(stream);
        // SAFETY: a live buffer of `count` elements; the input is staged.
        let r = unsafe { self.allreduce_raw(stream, T::DTYPE, count, p, p, algo) };
        settle(r, g, &[stream])
    }

    /// [`ProcessGroup::allreduce`] on raw device pointers of this rank's
    /// device. The input is staged, so `output == input` (in place) is allowed.
    ///
    /// Kernel errors (a peer that never arrives) show later: [`Self::poll`]
    /// (no wait) and [`Self::check`] report them, and the next call refuses
    /// to run until `reset`.
    ///
    /// # Safety
    /// `input` must be valid for reads and `output` for writes of `count`
    /// elements of `dtype` until the work on `stream` completes.
    pub unsafe fn allreduce_raw(
        &self,
        stream: &Arc<CudaStream>,
        dtype: Dtype,
        count: usize,
        input: u64,
        output: u64,
        algo: AlgoChoice,
    ) -> Result<Algorithm> {
        let mut i = [0u64; MAX_RANKS];
        let mut o = [0u64; MAX_RANKS];
        i[self.rank] = input;
        o[self.rank] = output;
        // SAFETY: forwarded from the caller.
        unsafe { self.core.staged(&[stream], dtype, count, &i, &o, algo) }
    }

    /// The fused allreduce + residual add + RMSNorm of this rank, as
    /// [`crate::PeerGroup::allreduce_add_rmsnorm`]: `input` (rows x hidden,
    /// hidden = `gamma.len()`) is summed over the ranks, `residual` is
    /// updated in place to `sum + residual`, and `normed` receives its
    /// RMSNorm times `gamma`; bits as docs/numerics.md says. Staged (inputs
    /// are copied), any number of rows (chunked). Every rank must call it
    /// with the same dtype, rows and hidden size.
    ///
    /// Kernel errors (a peer that never arrives) show later: [`Self::poll`]
    /// (no wait) and [`Self::check`] report them, and the next call refuses
    /// to run until `reset`.
    #[allow(clippy::too_many_arguments)]
    pub fn allreduce_add_rmsnorm<T, I, R, G, O>(
        &self,
        stream: &Arc<CudaStream>,
        input: &I,
        residual: &mut R,
        gamma: &G,
        eps: f32,
        normed: &mut O,
        algo: AlgoChoice,
    ) -> Result<Algorithm>
    where
        T: DeviceElement,
        I: DevicePtr<T>,
        R: DevicePtrMut<T>,
        G: DevicePtr<T>,
        O: DevicePtrMut<T>,
    {
        let (rows, hidden) = norm_shape(
            T::DTYPE,
            std::iter::once(input.len()),
            std::iter::once(residual.len()),
            std::iter::once(gamma.len()),
            std::iter::once(normed.len()),
            eps,
        )?;
        let (i, gi) = input.device_ptr(stream);
        let (r, gr) = residual.device_ptr_mut(stream);
        let (g, gg) = gamma.device_ptr(stream);
        let (o, go) = normed.device_ptr_mut(stream);
        // SAFETY: live slices or views of this rank's device holding what
        // norm_shape checked, guarded until the work is enqueued.
        let res = unsafe {
            self.allreduce_add_rmsnorm_raw(stream, T::DTYPE, rows, hidden, eps, [i, r, g, o], algo)
        };
        settle(res, (gi, gr, gg, go), &[stream])
    }

    /// [`ProcessGroup::allreduce_add_rmsnorm`] on raw device pointers
    /// `[input, residual, gamma, normed]` of this rank's device.
    ///
    /// # Safety
    /// `input` valid for reads, `residual` for reads and writes, `normed`
    /// for writes of `rows * hidden` elements of `dtype`, `gamma` for reads
    /// of `hidden`, until the work on `stream` completes; `normed` must not
    /// overlap the others.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn allreduce_add_rmsnorm_raw(
        &self,
        stream: &Arc<CudaStream>,
        dtype: Dtype,
        rows: usize,
        hidden: usize,
        eps: f32,
        ptrs: [u64; 4],
        algo: AlgoChoice,
    ) -> Result<Algorithm> {
        // SAFETY: forwarded from the caller.
        unsafe {
            self.fused(
                stream,
                dtype,
                rows,
                hidden,
                eps,
                ptrs,
                NormInputs::Staged,
                algo,
            )
        }
    }

    /// [`ProcessGroup::allreduce_add_rmsnorm_raw`] with zero-copy input:
    /// `input` lies inside a buffer registered by [`Self::register_buffer`]
    /// at the same offset on every rank, and the peers read it where it is
    /// (no staging copy; one launch: two-stage needs the rows to fit
    /// `Config::max_bytes`). `Error::NotRegistered` for another pointer.
    ///
    /// # Safety
    /// As for [`Self::allreduce_add_rmsnorm_raw`], and no rank may write its
    /// registered input while a call reads it; `residual` and `normed` must
    /// not overlap the registered input.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn allreduce_add_rmsnorm_registered_raw(
        &self,
        stream: &Arc<CudaStream>,
        dtype: Dtype,
        rows: usize,
        hidden: usize,
        eps: f32,
        ptrs: [u64; 4],
        algo: AlgoChoice,
    ) -> Result<Algorithm> {
        let bytes = (rows * hidden * dtype.size()) as u64;
        self.with_registered_table(stream, ptrs[0], bytes, |table| {
            let inputs = NormInputs::ZeroCopy(&[table]);
            // SAFETY: the table names every rank's registered buffer at
            // this offset, inside the smallest one registered (checked); the
            // rest is the caller's contract.
            unsafe { self.fused(stream, dtype, rows, hidden, eps, ptrs, inputs, algo) }
        })
    }

    /// [`ProcessGroup::allreduce_add_rmsnorm_raw`] captured in a CUDA
    /// graph with zero-copy input, as [`Self::allreduce_in_graph`]: the
    /// pointer table is filled by [`Self::register_captured`] after capture.
    ///
    /// # Safety
    /// As for [`Self::allreduce_in_graph`] (the input), and for
    /// [`Self::allreduce_add_rmsnorm_raw`] (the other pointers), for as long
    /// as the graph can be launched.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn allreduce_add_rmsnorm_in_graph(
        &self,
        stream: &Arc<CudaStream>,
        dtype: Dtype,
        rows: usize,
        hidden: usize,
        eps: f32,
        ptrs: [u64; 4],
        algo: AlgoChoice,
    ) -> Result<Algorithm> {
        let bytes = (rows * hidden * dtype.size()) as u64;
        let what = "allreduce_add_rmsnorm_in_graph";
        self.with_captured_table(what, stream, ptrs[0], bytes, |table| {
            let inputs = NormInputs::ZeroCopy(&[table]);
            // SAFETY: a zero slot filled by register_captured before a
            // replay can read it (a null input is reported by the kernel);
            // the rest is the caller's contract.
            unsafe { self.fused(stream, dtype, rows, hidden, eps, ptrs, inputs, algo) }
        })
    }

    /// One fused call of this rank, its input staged or read through a
    /// zero-copy table.
    ///
    /// # Safety
    /// As for [`Self::allreduce_add_rmsnorm_raw`]; a zero-copy table names
    /// every rank's input of `rows * hidden` elements and this group's
    /// scratch.
    #[allow(clippy::too_many_arguments)]
    unsafe fn fused(
        &self,
        stream: &Arc<CudaStream>,
        dtype: Dtype,
        rows: usize,
        hidden: usize,
        eps: f32,
        [input, residual, gamma, normed]: [u64; 4],
        inputs: NormInputs<'_>,
        algo: AlgoChoice,
    ) -> Result<Algorithm> {
        let ptrs = NormPtrs::one_rank(self.rank, input, residual, gamma, normed);
        // SAFETY: forwarded from the caller.
        unsafe {
            self.core
                .add_rmsnorm(&[stream], dtype, rows, hidden, eps, &ptrs, inputs, algo)
        }
    }

    /// [`ProcessGroup::allreduce`] after checking, through `exchange`, that
    /// every rank passes the same dtype, element count and algorithm choice.
    /// A mismatch is `Error::RankMismatch` on every rank, before any kernel
    /// runs. Without the check, calls that differ are caught by the
    /// kernels' 32-bit call tags at the peer timeout (`Error::CallMismatch`
    /// from `check()` on every rank, naming tags rather than whole calls;
    /// only pairs of the closed-form rule of `call_tag`, e.g. counts that
    /// differ by a multiple of 67,108,859, share a tag). Costs one host
    /// round trip per call: for debugging and for first calls.
    ///
    /// Kernel errors (a peer that never arrives) show later: [`Self::poll`]
    /// (no wait) and [`Self::check`] report them, and the next call refuses
    /// to run until `reset`.
    pub fn allreduce_checked<T, I, O>(
        &self,
        exchange: &dyn Exchange,
        stream: &Arc<CudaStream>,
        input: &I,
        output: &mut O,
        algo: AlgoChoice,
    ) -> Result<Algorithm>
    where
        T: DeviceElement,
        I: DevicePtr<T>,
        O: DevicePtrMut<T>,
    {
        let code = |a: AlgoChoice| match a {
            AlgoChoice::Auto => 0u8,
            AlgoChoice::OneStage => 1,
            AlgoChoice::TwoStage => 2,
            AlgoChoice::Push => 3,
            AlgoChoice::PushLl => 4,
            AlgoChoice::PushTwoStage => 5,
            AlgoChoice::PushIslands => 6,
        };
        let mut mine = vec![T::DTYPE as u32 as u8, code(algo)];
        mine.extend_from_slice(&(input.len() as u64).to_le_bytes());
        let all = exchange.all_gather(&mine)?;
        let decode = |b: &[u8]| -> Option<(Dtype, u8, usize)> {
            let first = *b.first()?;
            let dtype = Dtype::ALL.into_iter().find(|d| *d as u32 as u8 == first)?;
            let count = u64::from_le_bytes(b.get(2..10)?.try_into().ok()?) as usize;
            Some((dtype, *b.get(1)?, count))
        };
        let (dtype0, algo0, count0) = decode(&all[0])
            .ok_or_else(|| Error::Rendezvous("rank 0 sent a malformed call record".into()))?;
        for (r, b) in all.iter().enumerate() {
            let (dtype, a, count) = decode(b).ok_or_else(|| {
                Error::Rendezvous(format!("rank {r} sent a malformed call record"))
            })?;
            if (dtype, count) != (dtype0, count0) {
                return Err(Error::RankMismatch {
                    rank: r,
                    dtype,
                    count,
                    dtype0,
                    count0,
                });
            }
            if a != algo0 {
                return Err(Error::GroupMismatch {
                    rank: self.rank,
                    other: r,
                    what: "the algorithm choice of this allreduce differs".into(),
                });
            }
        }
        self.allreduce(stream, input, output, algo)
    }

    /// Zero-copy allreduce for CUDA-graph capture: peers read `input` itself.
    /// `stream` must be capturing. The kernel's pointer table is a slot that
    /// [`ProcessGroup::register_captured`] fills after capture, once the
    /// ranks have exchanged IPC handles of the captured buffers; launching the
    /// graph before that is reported as `Error::Unregistered`, not a crash.
    /// Every rank must capture the same allreduces in the same order. Not
    /// chunked: an explicit two-stage larger than the scratch is refused.
    ///
    /// Kernel errors (a peer that never arrives) show later: [`Self::poll`]
    /// (no wait) and [`Self::check`] report them, and the next call refuses
    /// to run until `reset`.
    ///
    /// # Safety
    /// `input` and `output` must stay valid for `count` elements of `dtype`
    /// for as long as the graph can be launched; `input` must come from plain
    /// `cuMemAlloc` (CUDA IPC cannot export stream-ordered pool memory) and
    /// must not be written while a replay runs.
    pub unsafe fn allreduce_in_graph(
        &self,
        stream: &Arc<CudaStream>,
        dtype: Dtype,
        count: usize,
        input: u64,
        output: u64,
        algo: AlgoChoice,
    ) -> Result<Algorithm> {
        let mut o = [0u64; MAX_RANKS];
        o[self.rank] = output;
        let bytes = (count * dtype.size()) as u64;
        self.with_captured_table("allreduce_in_graph", stream, input, bytes, |table| {
            // SAFETY: the table is a zero slot that register_captured fills
            // before a replay can read it (a null input is reported by the
            // kernel); input and output are the caller's contract.
            unsafe {
                self.core
                    .zero_copy(&[stream], dtype, count, &[table], &o, algo)
            }
        })
    }

    /// Runs `launch` with the pointer table of a zero-copy call reading
    /// `bytes` bytes at `input`, inside a registered buffer (made at the
    /// first call for its offset, so not during capture).
    fn with_registered_table<T>(
        &self,
        stream: &Arc<CudaStream>,
        input: u64,
        bytes: u64,
        launch: impl FnOnce(u64) -> Result<T>,
    ) -> Result<T> {
        self.core.ensure_ok()?;
        let capturing = driver::is_capturing(stream)?;
        let table = {
            let mut tables = self.tables.lock().unwrap_or_else(|p| p.into_inner());
            tables.registered_table(input, bytes, capturing)?
        };
        launch(table)
    }

    /// Runs `launch` (of the call `what`) with a zero table slot for a
    /// zero-copy call captured on `stream`, reading `bytes` bytes at
    /// `input`; the slot is kept for `register_captured` if it succeeds.
    fn with_captured_table<T>(
        &self,
        what: &str,
        stream: &Arc<CudaStream>,
        input: u64,
        bytes: u64,
        launch: impl FnOnce(u64) -> Result<T>,
    ) -> Result<T> {
        self.core.ensure_ok()?;
        if !driver::is_capturing(stream)? {
            return Err(Error::Config(format!(
                "{what} needs a stream that is capturing a CUDA graph; outside capture use the staged or registered call"
            )));
        }
        let mut tables = self.tables.lock().unwrap_or_else(|p| p.into_inner());
        tables.capture(input, bytes, launch)
    }

    /// Fills the pointer tables of every allreduce captured (by
    /// [`Self::allreduce_in_graph`]) since the last call, after exchanging
    /// the IPC handles of their inputs through `exchange`: a collective call,
    /// made by every rank after capture and before the first replay. Returns
    /// how many it registered.
    pub fn register_captured(&self, exchange: &dyn Exchange) -> Result<usize> {
        let mut tables = self.tables.lock().unwrap_or_else(|p| p.into_inner());
        tables.register_captured(exchange)
    }

    /// Registers this rank's buffer at `ptr` (`bytes` bytes, 16-byte aligned,
    /// from plain `cuMemAlloc`) with the other ranks' buffers, for
    /// zero-copy eager allreduces ([`Self::allreduce_registered_raw`]): a
    /// collective call, every rank registering its own buffer in the same
    /// order. The group maps the peers' buffers until it is dropped.
    ///
    /// # Safety
    /// The buffer must stay allocated as long as the group may run an
    /// allreduce on it.
    pub unsafe fn register_buffer(
        &self,
        exchange: &dyn Exchange,
        ptr: u64,
        bytes: usize,
    ) -> Result<usize> {
        self.core.ensure_ok()?;
        let mut tables = self.tables.lock().unwrap_or_else(|p| p.into_inner());
        tables.register_buffer(exchange, ptr, bytes as u64)
    }

    /// Whether `ptr` lies inside a buffer registered by [`Self::register_buffer`].
    pub fn is_registered(&self, ptr: u64) -> bool {
        let tables = self.tables.lock().unwrap_or_else(|p| p.into_inner());
        tables.is_registered(ptr)
    }

    /// Zero-copy allreduce of `count` elements at `input`, which lies inside
    /// a buffer registered by [`Self::register_buffer`] at the same offset
    /// on every rank: peers read it where it is, with no staging copy.
    /// `Error::NotRegistered` for any other pointer. `output` must not
    /// overlap any rank's input (use a separate buffer and copy back for an
    /// in-place result: when this rank's kernel has finished, the peers have
    /// finished reading its input). Not chunked: a message larger than
    /// `Config::max_bytes` is refused for the algorithms that need scratch.
    ///
    /// # Safety
    /// `input` must be valid for reads and `output` for writes of `count`
    /// elements of `dtype` until the work on `stream` completes, and no
    /// rank may write its registered input while an allreduce reads it.
    pub unsafe fn allreduce_registered_raw(
        &self,
        stream: &Arc<CudaStream>,
        dtype: Dtype,
        count: usize,
        input: u64,
        output: u64,
        algo: AlgoChoice,
    ) -> Result<Algorithm> {
        let mut o = [0u64; MAX_RANKS];
        o[self.rank] = output;
        let bytes = (count * dtype.size()) as u64;
        self.with_registered_table(stream, input, bytes, |table| {
            // SAFETY: the table names every rank's registered buffer at
            // this offset, inside the smallest one registered (checked); the
            // caller keeps input and output valid.
            unsafe {
                self.core
                    .zero_copy(&[stream], dtype, count, &[table], &o, algo)
            }
        })
    }

    /// Reports an error a kernel of this group has recorded so far (a peer
    /// timeout), without waiting for the device: the kernels raise a mailbox
    /// in pinned host memory, so this costs a host memory read while all is
    /// well. Every allreduce call asks the same before it enqueues anything,
    /// so after an error the next call fails instead of returning `Ok`;
    /// an error of work still running shows once it is recorded.
    /// [`Self::check`] waits for the device and then reports.
    pub fn poll(&self) -> Result<()> {
        self.core.ensure_ok()
    }

    /// Waits for `stream`, then reports an error this rank's kernels recorded.
    pub fn check(&self, stream: &Arc<CudaStream>) -> Result<()> {
        self.core.check(&[stream])
    }

    /// Zeroes this rank's signal and landing zone after waiting for the device. Every rank
    /// must reset (and agree on it out of band) before the next collective.
    pub fn reset(&self) -> Result<()> {
        self.core.reset()
    }

    /// Fault injection for your own tests, as
    /// [`crate::VirtualGroup::launch_with_absent_ranks`]: every rank calls
    /// it; the ranks in `absent_ranks` leave at once and the others record
    /// `PeerTimeout`, which [`ProcessGroup::check`] reports. Does not wait.
    pub fn launch_with_absent_ranks(
        &self,
        stream: &Arc<CudaStream>,
        absent_ranks: u32,
        dtype: Dtype,
        algorithm: Algorithm,
        count: usize,
    ) -> Result<()> {
        let faults = Faults::absent(absent_ranks);
        self.core
            .launch_with_faults(&[stream], faults, dtype, algorithm, count)
    }
}

#[cfg(test)]
mod tests;
