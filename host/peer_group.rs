//! [`PeerGroup`]: one rank per context in one process — several GPUs with
//! peer access, or several ranks sharing a GPU — one launch per rank on
//! that rank's stream.

use crate::abi::{Algorithm, Dtype};
use crate::checks::{by_rank, check_count, check_world, count_of};
use crate::collective::{settle, Collective, Member, RankBuffers};
use crate::driver::{self, DeviceAlloc, Kernels};
use crate::element::{DeviceElement, RoutedElement};
use crate::error::{Error, Result};
use crate::fused::{norm_shape, NormBuffers, NormInputs, NormPtrs};
use crate::launch::{Faults, Ranks};
use crate::machine;
use crate::plan::{AlgoChoice, Config, Link};
use crate::registered::RegisteredBuffers;
use crate::thresholds::{Backend, Mode};
use crate::topology;
use crate::virtual_group::table_of;
use cudarc::driver::{CudaContext, CudaStream, DevicePtr, DevicePtrMut};
use std::marker::PhantomData;
use std::sync::Arc;

/// Which path a routed allreduce took.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Route {
    Kernel(Algorithm),
    Nccl,
}

/// One rank per context in one process: several GPUs with peer access, or
/// several ranks sharing a GPU (each launch on its own stream).
///
/// Every call takes one stream per rank (`streams[r]` on rank r's device,
/// no stream twice) and enqueues rank r's work on it; nothing waits on the
/// host except [`PeerGroup::check`]. Kernel errors (a peer timeout) are
/// reported by `check`, and every later call refuses to run (a kernel
/// raises a host mailbox, so this needs no device sync: see
/// [`PeerGroup::poll`]).
///
/// CUDA graphs: capture every rank's stream, call the allreduce, end every
/// capture, and launch each rank's graph on its stream. Capture the streams
/// in `CU_STREAM_CAPTURE_MODE_RELAXED` (ending one capture instantiates its
/// graph, which thread-local mode refuses while the other streams still
/// capture), and either disable cudarc's event tracking on the contexts
/// (`CudaContext::disable_event_tracking`) before allocating the buffers
/// you capture, or pass raw pointers ([`PeerGroup::allreduce_raw`],
/// [`PeerGroup::allreduce_registered_raw`]): with the tracking on, taking a
/// cudarc slice's pointer during capture waits for an event recorded
/// before it, which CUDA refuses (the call returns
/// `Error::CaptureInvalidated`).
pub struct PeerGroup {
    core: Collective,
    #[cfg(feature = "nccl")]
    nccl: Option<crate::nccl::NcclGroup>,
}

impl std::fmt::Debug for PeerGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let devices: Vec<usize> = self
            .core
            .members
            .iter()
            .map(|m| m.kernels.context().ordinal())
            .collect();
        f.debug_struct("PeerGroup")
            .field("world", &self.core.world)
            .field("devices", &devices)
            .field("link", &self.core.link)
            .field("config", &self.core.config)
            .field("id", &self.core.id)
            .finish()
    }
}

impl PeerGroup {
    /// `contexts[r]` is rank r's device. Peer access is enabled between every
    /// pair of distinct devices; a pair without a P2P path is an error.
    pub fn new(contexts: &[Arc<CudaContext>], config: Config) -> Result<Self> {
        let world = contexts.len();
        check_world(world)?;
        config.validate().map_err(Error::Config)?;
        let mut link = Link::SameDevice;
        for ca in contexts {
            for cb in contexts {
                if ca.cu_device() == cb.cu_device() {
                    continue;
                }
                let l = topology::link_between(ca, cb)?.ok_or(Error::NoPeerAccess {
                    a: ca.ordinal(),
                    b: cb.ordinal(),
                })?;
                link = topology::slowest(link, l);
                driver::enable_peer_access(ca, cb)?;
            }
        }
        let config = Config {
            thresholds: machine::resolve_thresholds(&config.thresholds, &contexts[0], link, world)?,
            ..config
        };
        let mut kernels = Vec::with_capacity(world);
        let mut own = Vec::with_capacity(world);
        for (r, ctx) in contexts.iter().enumerate() {
            let k = Kernels::for_context(ctx, config.kernel_image)?;
            k.prepare(world, false, config.threads_per_block)?;
            kernels.push(k);
            own.push((r, RankBuffers::new(ctx, &config, world)?));
        }
        let staging = by_rank(own.iter().map(|(_, b)| b.staging.ptr()));
        let signals = by_rank(own.iter().map(|(_, b)| b.signal.ptr()));
        let t = table_of(|r| staging[r], &own);
        let members = kernels
            .into_iter()
            .zip(contexts)
            .enumerate()
            .map(|(r, (k, ctx))| {
                Member::new(k, Ranks::One(r), staging, DeviceAlloc::from_value(ctx, &t)?)
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(PeerGroup {
            core: Collective::new(world, config, link, signals, members, own),
            #[cfg(feature = "nccl")]
            nccl: None,
        })
    }

    pub fn world(&self) -> usize {
        self.core.world
    }
    /// The slowest link between two of the group's devices.
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

    /// Creates NCCL communicators over `streams` (one per rank, distinct
    /// GPUs), so that [`PeerGroup::allreduce_routed`] can hand NCCL the
    /// sizes the table gives it ([`PeerGroup::nccl_wins`]) and those above
    /// `Config::nccl_above`.
    #[cfg(feature = "nccl")]
    pub fn enable_nccl(&mut self, streams: &[Arc<CudaStream>]) -> Result<()> {
        check_count("streams", streams.len(), self.world())?;
        self.nccl = Some(crate::nccl::NcclGroup::new(streams)?);
        Ok(())
    }

    /// [`PeerGroup::allreduce`], except that under `AlgoChoice::Auto`, when
    /// NCCL was enabled (`PeerGroup::enable_nccl`, feature `nccl`), a message goes to
    /// NCCL where the table measured NCCL faster ([`PeerGroup::nccl_wins`]:
    /// a band won by `nccl` or `nccl_symmetric`; NCCL runs on the
    /// caller's buffers, so the symmetric kernels only where those lie in
    /// NCCL's windows) or where it is larger than `Config::nccl_above`. NCCL's
    /// bits are not the contract's: `AlgoChoice::Auto` through
    /// [`PeerGroup::allreduce`] (or no `enable_nccl`) keeps every size on
    /// our kernels. Without the `nccl` feature this is `allreduce`.
    ///
    /// Kernel errors (a peer that never arrives) show later: [`Self::poll`]
    /// (no wait) and [`Self::check`] report them, and the next call refuses
    /// to run until `reset`.
    pub fn allreduce_routed<T, I, O>(
        &self,
        streams: &[Arc<CudaStream>],
        inputs: &[&I],
        outputs: &mut [O],
        algo: AlgoChoice,
    ) -> Result<Route>
    where
        T: RoutedElement,
        I: DevicePtr<T>,
        O: DevicePtrMut<T>,
    {
        #[cfg(feature = "nccl")]
        if let (Some(n), AlgoChoice::Auto) = (&self.nccl, algo) {
            let count = inputs.first().map_or(0, |i| i.len());
            let bytes = count.saturating_mul(T::DTYPE.size());
            let above = self.core.config.nccl_above.is_some_and(|a| bytes > a);
            if above || self.nccl_wins(count, T::DTYPE) {
                self.core.ensure_ok()?;
                n.allreduce(streams, inputs, outputs)?;
                return Ok(Route::Nccl);
            }
        }
        self.allreduce(streams, inputs, outputs, algo)
            .map(Route::Kernel)
    }

    /// Staged allreduce: rank r copies `inputs[r]` (a slice or view on its
    /// device) into its staging buffer and launches on `streams[r]`, writing
    /// `outputs[r]`. Returns the algorithm of the whole call; messages
    /// above `Config::max_bytes` run in chunks.
    ///
    /// Kernel errors (a peer that never arrives) show later: [`Self::poll`]
    /// (no wait) and [`Self::check`] report them, and the next call refuses
    /// to run until `reset`.
    pub fn allreduce<T, I, O>(
        &self,
        streams: &[Arc<CudaStream>],
        inputs: &[&I],
        outputs: &mut [O],
        algo: AlgoChoice,
    ) -> Result<Algorithm>
    where
        T: DeviceElement,
        I: DevicePtr<T>,
        O: DevicePtrMut<T>,
    {
        check_count("streams", streams.len(), self.world())?;
        check_count("inputs", inputs.len(), self.world())?;
        check_count("outputs", outputs.len(), self.world())?;
        let count = count_of(
            T::DTYPE,
            inputs.iter().map(|i| i.len()),
            outputs.iter().map(|o| o.len()),
        )?;
        let ins: Vec<_> = inputs
            .iter()
            .zip(streams)
            .map(|(i, s)| i.device_ptr(s))
            .collect();
        let outs: Vec<_> = outputs
            .iter_mut()
            .zip(streams)
            .map(|(o, s)| o.device_ptr_mut(s))
            .collect();
        let i: Vec<u64> = ins.iter().map(|p| p.0).collect();
        let o: Vec<u64> = outs.iter().map(|p| p.0).collect();
        // SAFETY: every pointer comes from a live slice or view of at least
        // `count` elements on its rank's device, guarded until enqueued.
        let r = unsafe { self.allreduce_raw(streams, T::DTYPE, count, &i, &o, algo) };
        let s: Vec<&Arc<CudaStream>> = streams.iter().collect();
        settle(r, (ins, outs), &s)
    }

    /// Fused allreduce + residual add + RMSNorm on every rank (rank r's
    /// buffers on its device, work on `streams[r]`); as
    /// [`VirtualGroup::allreduce_add_rmsnorm`](crate::VirtualGroup::allreduce_add_rmsnorm):
    /// `residual[r]` updated in place, `normed[r]` written, rows of
    /// `gamma[r].len()` elements, bits of docs/numerics.md.
    #[allow(clippy::too_many_arguments)]
    pub fn allreduce_add_rmsnorm<T, I, R, G, O>(
        &self,
        streams: &[Arc<CudaStream>],
        inputs: &[&I],
        residual: &mut [R],
        gamma: &[&G],
        eps: f32,
        normed: &mut [O],
        algo: AlgoChoice,
    ) -> Result<Algorithm>
    where
        T: DeviceElement,
        I: DevicePtr<T>,
        R: DevicePtrMut<T>,
        G: DevicePtr<T>,
        O: DevicePtrMut<T>,
    {
        check_count("streams", streams.len(), self.world())?;
        let b = NormBuffers::staged(self.world(), streams, inputs, residual, gamma, eps, normed)?;
        let refs: Vec<&Arc<CudaStream>> = streams.iter().collect();
        // SAFETY: every pointer comes from a live slice or view on its
        // rank's device holding what `NormBuffers` checked, guarded until
        // the work is enqueued.
        let r = unsafe {
            self.core.add_rmsnorm(
                &refs,
                T::DTYPE,
                b.rows,
                b.hidden,
                eps,
                &b.ptrs,
                NormInputs::Staged,
                algo,
            )
        };
        settle(r, b, &refs)
    }

    /// [`Self::allreduce_add_rmsnorm`] with the normed rows written over
    /// each rank's input `x[r]` (staged: the inputs are read before they
    /// are overwritten), as
    /// [`VirtualGroup::allreduce_add_rmsnorm_in_place`](crate::VirtualGroup::allreduce_add_rmsnorm_in_place).
    ///
    /// Kernel errors (a peer that never arrives) show later: [`Self::poll`]
    /// (no wait) and [`Self::check`] report them, and the next call refuses
    /// to run until `reset`.
    pub fn allreduce_add_rmsnorm_in_place<T, X, R, G>(
        &self,
        streams: &[Arc<CudaStream>],
        x: &mut [X],
        residual: &mut [R],
        gamma: &[&G],
        eps: f32,
        algo: AlgoChoice,
    ) -> Result<Algorithm>
    where
        T: DeviceElement,
        X: DevicePtrMut<T>,
        R: DevicePtrMut<T>,
        G: DevicePtr<T>,
    {
        check_count("streams", streams.len(), self.world())?;
        let b = NormBuffers::in_place(self.world(), streams, x, residual, gamma, eps)?;
        let refs: Vec<&Arc<CudaStream>> = streams.iter().collect();
        // SAFETY: live buffers on their ranks' devices holding what
        // `NormBuffers` checked, guarded until the work is enqueued; the
        // inputs are staged, so writing the normed rows over them is
        // allowed.
        let r = unsafe {
            self.core.add_rmsnorm(
                &refs,
                T::DTYPE,
                b.rows,
                b.hidden,
                eps,
                &b.ptrs,
                NormInputs::Staged,
                algo,
            )
        };
        settle(r, b, &refs)
    }

    /// In-place allreduce: every rank's buffer is both input and output.
    ///
    /// Kernel errors (a peer that never arrives) show later: [`Self::poll`]
    /// (no wait) and [`Self::check`] report them, and the next call refuses
    /// to run until `reset`.
    pub fn allreduce_in_place<T, B>(
        &self,
        streams: &[Arc<CudaStream>],
        buffers: &mut [B],
        algo: AlgoChoice,
    ) -> Result<Algorithm>
    where
        T: DeviceElement,
        B: DevicePtrMut<T>,
    {
        check_count("streams", streams.len(), self.world())?;
        check_count("buffers", buffers.len(), self.world())?;
        let count = count_of(
            T::DTYPE,
            buffers.iter().map(|b| b.len()),
            std::iter::empty(),
        )?;
        let bufs: Vec<_> = buffers
            .iter_mut()
            .zip(streams)
            .map(|(b, s)| b.device_ptr_mut(s))
            .collect();
        let p: Vec<u64> = bufs.iter().map(|p| p.0).collect();
        // SAFETY: live buffers of `count` elements; inputs are staged.
        let r = unsafe { self.allreduce_raw(streams, T::DTYPE, count, &p, &p, algo) };
        let s: Vec<&Arc<CudaStream>> = streams.iter().collect();
        settle(r, bufs, &s)
    }

    /// [`PeerGroup::allreduce`] on raw device pointers: `inputs[r]` and
    /// `outputs[r]` on rank r's device. Inputs are staged, so
    /// `outputs[r] == inputs[r]` (in place) is allowed.
    ///
    /// Kernel errors (a peer that never arrives) show later: [`Self::poll`]
    /// (no wait) and [`Self::check`] report them, and the next call refuses
    /// to run until `reset`.
    ///
    /// # Safety
    /// `inputs[r]` must be valid for reads and `outputs[r]` for writes of
    /// `count` elements of `dtype` until the work on `streams[r]` completes.
    pub unsafe fn allreduce_raw(
        &self,
        streams: &[Arc<CudaStream>],
        dtype: Dtype,
        count: usize,
        inputs: &[u64],
        outputs: &[u64],
        algo: AlgoChoice,
    ) -> Result<Algorithm> {
        check_count("inputs", inputs.len(), self.world())?;
        check_count("outputs", outputs.len(), self.world())?;
        let s: Vec<&Arc<CudaStream>> = streams.iter().collect();
        let (i, o) = (
            by_rank(inputs.iter().copied()),
            by_rank(outputs.iter().copied()),
        );
        // SAFETY: forwarded from the caller.
        unsafe { self.core.staged(&s, dtype, count, &i, &o, algo) }
    }

    /// [`PeerGroup::allreduce_add_rmsnorm`] on raw device pointers:
    /// `ptrs[r]` is rank r's `[input, residual, gamma, normed]` on its
    /// device, every rank's call of `rows x hidden` elements of `dtype`.
    /// Staged, so `normed` may be the input (in place).
    ///
    /// Kernel errors (a peer that never arrives) show later: [`Self::poll`]
    /// (no wait) and [`Self::check`] report them, and the next call refuses
    /// to run until `reset`.
    ///
    /// # Safety
    /// For every rank r: `input` valid for reads, `residual` for reads and
    /// writes, `normed` for writes of `rows * hidden` elements of `dtype`,
    /// `gamma` for reads of `hidden`, on rank r's device until the work on
    /// `streams[r]` completes; `normed` must not overlap `residual` or
    /// `gamma`.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn allreduce_add_rmsnorm_raw(
        &self,
        streams: &[Arc<CudaStream>],
        dtype: Dtype,
        rows: usize,
        hidden: usize,
        eps: f32,
        ptrs: &[[u64; 4]],
        algo: AlgoChoice,
    ) -> Result<Algorithm> {
        check_count("streams", streams.len(), self.world())?;
        check_count("pointer sets", ptrs.len(), self.world())?;
        // The shape rules of the typed call (whole rows, eps), on lengths.
        let n = rows
            .checked_mul(hidden)
            .ok_or_else(|| Error::NormShape(format!("{rows} rows x {hidden} elements overflow")))?;
        let w = self.world();
        let (rows, hidden) = norm_shape(
            dtype,
            std::iter::repeat_n(n, w),
            std::iter::repeat_n(n, w),
            std::iter::repeat_n(hidden, w),
            std::iter::repeat_n(n, w),
            eps,
        )?;
        let col = |i: usize| by_rank(ptrs.iter().map(|p| p[i]));
        let p = NormPtrs {
            inputs: col(0),
            residual: col(1),
            residual_out: col(1),
            gamma: col(2),
            normed: col(3),
        };
        let refs: Vec<&Arc<CudaStream>> = streams.iter().collect();
        // SAFETY: forwarded from the caller; the inputs are staged.
        unsafe {
            self.core.add_rmsnorm(
                &refs,
                dtype,
                rows,
                hidden,
                eps,
                &p,
                NormInputs::Staged,
                algo,
            )
        }
    }

    /// Allocates registered (zero-copy) input buffers of `len` elements per
    /// rank, each on its rank's device; peers read them directly.
    pub fn alloc_registered<T: DeviceElement>(&self, len: usize) -> Result<RegisteredBuffers<T>> {
        let ctxs: Vec<Arc<CudaContext>> = self
            .core
            .members
            .iter()
            .map(|m| m.kernels.context().clone())
            .collect();
        let bufs = ctxs
            .iter()
            .map(|c| DeviceAlloc::zeroed(c, len * T::DTYPE.size()))
            .collect::<Result<Vec<_>>>()?;
        let t = table_of(|r| bufs[r].ptr(), &self.core.own);
        let tables = ctxs
            .iter()
            .map(|c| DeviceAlloc::from_value(c, &t))
            .collect::<Result<Vec<_>>>()?;
        Ok(RegisteredBuffers {
            bufs,
            tables,
            len,
            group: self.core.id,
            ctxs,
            _t: PhantomData,
        })
    }

    /// Zero-copy allreduce of the first `count` elements of `reg` (written
    /// by each rank on its own stream beforehand) into `outputs`, with no
    /// staging copy; works inside CUDA-graph capture (see the type's docs).
    /// Not chunked: a two-stage larger than the scratch runs one-stage
    /// under `Auto` (same bits) and is refused when asked for explicitly.
    ///
    /// Kernel errors (a peer that never arrives) show later: [`Self::poll`]
    /// (no wait) and [`Self::check`] report them, and the next call refuses
    /// to run until `reset`.
    pub fn allreduce_registered<T, O>(
        &self,
        streams: &[Arc<CudaStream>],
        reg: &RegisteredBuffers<T>,
        count: usize,
        outputs: &mut [O],
        algo: AlgoChoice,
    ) -> Result<Algorithm>
    where
        T: DeviceElement,
        O: DevicePtrMut<T>,
    {
        check_count("streams", streams.len(), self.world())?;
        check_count("outputs", outputs.len(), self.world())?;
        count_of(
            T::DTYPE,
            std::iter::once(count),
            outputs.iter().map(|o| o.len()),
        )?;
        let outs: Vec<_> = outputs
            .iter_mut()
            .zip(streams)
            .map(|(o, s)| o.device_ptr_mut(s))
            .collect();
        let o = by_rank(outs.iter().map(|p| p.0));
        let s: Vec<&Arc<CudaStream>> = streams.iter().collect();
        // SAFETY: every output holds >= count elements (checked above).
        let r = unsafe { self.core.registered(&s, reg, count, &o, algo) };
        settle(r, outs, &s)
    }

    /// [`Self::allreduce_registered`] with raw output pointers (`outputs[r]`
    /// on rank r's device): for outputs that are not cudarc slices, and for
    /// graph capture with cudarc's event tracking on (see
    /// `Error::CaptureInvalidated`).
    ///
    /// # Safety
    /// `outputs[r]` must be valid for writes of `count` elements of `T`
    /// until the work on `streams[r]` completes (for as long as a captured
    /// graph can be launched), and must not overlap the registered buffers.
    pub unsafe fn allreduce_registered_raw<T: DeviceElement>(
        &self,
        streams: &[Arc<CudaStream>],
        reg: &RegisteredBuffers<T>,
        count: usize,
        outputs: &[u64],
        algo: AlgoChoice,
    ) -> Result<Algorithm> {
        check_count("streams", streams.len(), self.world())?;
        check_count("outputs", outputs.len(), self.world())?;
        let o = by_rank(outputs.iter().copied());
        let s: Vec<&Arc<CudaStream>> = streams.iter().collect();
        // SAFETY: forwarded from the caller.
        unsafe { self.core.registered(&s, reg, count, &o, algo) }
    }

    /// [`Self::allreduce_add_rmsnorm`] with zero-copy input: the first
    /// `count` elements (whole rows of `gamma[r].len()`) of each rank's
    /// registered buffer, written beforehand on its stream, read where they
    /// are by every peer (no staging copy; one launch, not chunked: an
    /// explicit two-stage whose rows do not fit the scratch is refused with
    /// `ScratchTooSmall`, a push_ll whose rows do not fit its landing zone
    /// with `ZoneTooSmall`; `Auto` runs one-stage there); works inside
    /// CUDA-graph capture as [`Self::allreduce_registered`] does.
    /// `residual[r]` updated in place, `normed[r]` written, as the staged
    /// call.
    #[allow(clippy::too_many_arguments)]
    pub fn allreduce_add_rmsnorm_registered<T, R, G, O>(
        &self,
        streams: &[Arc<CudaStream>],
        reg: &RegisteredBuffers<T>,
        count: usize,
        residual: &mut [R],
        gamma: &[&G],
        eps: f32,
        normed: &mut [O],
        algo: AlgoChoice,
    ) -> Result<Algorithm>
    where
        T: DeviceElement,
        R: DevicePtrMut<T>,
        G: DevicePtr<T>,
        O: DevicePtrMut<T>,
    {
        check_count("streams", streams.len(), self.world())?;
        let b = NormBuffers::registered(
            self.world(),
            streams,
            reg,
            count,
            residual,
            gamma,
            eps,
            normed,
        )?;
        let refs: Vec<&Arc<CudaStream>> = streams.iter().collect();
        // SAFETY: residuals, gammas and outputs are live slices or views on
        // their ranks' devices holding what `NormBuffers` checked, guarded
        // until the work is enqueued; they cannot overlap the registered
        // buffers, which only `reg` owns.
        let r = unsafe {
            self.core
                .add_rmsnorm_registered(&refs, reg, b.rows, b.hidden, eps, &b.ptrs, algo)
        };
        settle(r, b, &refs)
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

    /// Waits for every rank's stream and reports recorded kernel errors.
    /// After an error the group is poisoned until [`PeerGroup::reset`].
    pub fn check(&self, streams: &[Arc<CudaStream>]) -> Result<()> {
        let s: Vec<&Arc<CudaStream>> = streams.iter().collect();
        self.core.check(&s)
    }

    /// Zeroes every rank's signal and landing zone after waiting for all devices.
    pub fn reset(&self) -> Result<()> {
        self.core.reset()
    }

    /// Fault injection for your own tests, as
    /// [`crate::VirtualGroup::launch_with_absent_ranks`]: the ranks in
    /// `absent_ranks` leave at once; the others record `PeerTimeout`, which
    /// [`PeerGroup::check`] reports. Does not wait.
    pub fn launch_with_absent_ranks(
        &self,
        streams: &[Arc<CudaStream>],
        absent_ranks: u32,
        dtype: Dtype,
        algorithm: Algorithm,
        count: usize,
    ) -> Result<()> {
        self.launch_with_faults(
            streams,
            Faults::absent(absent_ranks),
            dtype,
            algorithm,
            count,
        )
    }

    /// Fault injection for your own tests: one collective in which the
    /// ranks in `mismatched_ranks` (bit r: rank r) carry another call's
    /// tag, as ranks whose call differs from the others' would; every rank
    /// then records `CallMismatch` (or `PeerTimeout` where it saw no word
    /// of another call), which [`PeerGroup::check`] reports. Does not wait.
    pub fn launch_with_mismatched_ranks(
        &self,
        streams: &[Arc<CudaStream>],
        mismatched_ranks: u32,
        dtype: Dtype,
        algorithm: Algorithm,
        count: usize,
    ) -> Result<()> {
        let faults = Faults::mismatched(mismatched_ranks);
        self.launch_with_faults(streams, faults, dtype, algorithm, count)
    }

    /// The fused call's [`Self::launch_with_mismatched_ranks`], as
    /// [`Self::add_rmsnorm_with_absent_ranks`]. Does not wait.
    pub fn add_rmsnorm_with_mismatched_ranks(
        &self,
        streams: &[Arc<CudaStream>],
        mismatched_ranks: u32,
        dtype: Dtype,
        algorithm: AlgoChoice,
        rows: usize,
        hidden: usize,
    ) -> Result<Algorithm> {
        let faults = Faults::mismatched(mismatched_ranks);
        self.add_rmsnorm_with_faults(streams, faults, dtype, algorithm, rows, hidden)
    }

    /// Fault injection for the fused call, as
    /// [`crate::VirtualGroup::add_rmsnorm_with_absent_ranks`]: one fused
    /// allreduce + residual add + RMSNorm of `rows x hidden` elements of
    /// `dtype` with `algorithm` over the group's own buffers, in which the
    /// ranks in `absent_ranks` (bit r: rank r) leave at once; the others
    /// wait for them until the timeout and record `PeerTimeout`, which
    /// [`PeerGroup::check`] reports. Returns the algorithm that ran
    /// (refusals as for the fused call; `rows * hidden` must fit
    /// `Config::max_bytes`). Does not wait, as
    /// [`Self::launch_with_absent_ranks`].
    pub fn add_rmsnorm_with_absent_ranks(
        &self,
        streams: &[Arc<CudaStream>],
        absent_ranks: u32,
        dtype: Dtype,
        algorithm: AlgoChoice,
        rows: usize,
        hidden: usize,
    ) -> Result<Algorithm> {
        let faults = Faults::absent(absent_ranks);
        self.add_rmsnorm_with_faults(streams, faults, dtype, algorithm, rows, hidden)
    }

    /// The fault injection of both kinds, on one stream per member.
    fn launch_with_faults(
        &self,
        streams: &[Arc<CudaStream>],
        faults: Faults,
        dtype: Dtype,
        algorithm: Algorithm,
        count: usize,
    ) -> Result<()> {
        let s: Vec<&Arc<CudaStream>> = streams.iter().collect();
        self.core
            .launch_with_faults(&s, faults, dtype, algorithm, count)
    }

    /// The fused fault injection of both kinds, on one stream per member.
    fn add_rmsnorm_with_faults(
        &self,
        streams: &[Arc<CudaStream>],
        faults: Faults,
        dtype: Dtype,
        algorithm: AlgoChoice,
        rows: usize,
        hidden: usize,
    ) -> Result<Algorithm> {
        let s: Vec<&Arc<CudaStream>> = streams.iter().collect();
        self.core
            .add_rmsnorm_with_faults(&s, faults, dtype, rows, hidden, algorithm)
    }
}
