//! [`VirtualGroup`]: N ranks on one GPU in one process; one launch runs all
//! ranks (rank = `blockIdx.y`). This is how one GPU tests the real kernels
//! and the real barrier protocol.

use crate::abi::{Algorithm, Dtype, RankTable, MAX_RANKS};
use crate::checks::{by_rank, check_count, check_world, count_of};
use crate::collective::{settle, Collective, Member, RankBuffers};
use crate::driver::{DeviceAlloc, Kernels};
use crate::element::DeviceElement;
use crate::error::{Context as _, Error, Result};
use crate::fused::{NormBuffers, NormInputs};
use crate::launch::{Faults, Ranks};
use crate::machine;
use crate::plan::{AlgoChoice, Config, Link};
use crate::registered::RegisteredBuffers;
use crate::thresholds::{Backend, Mode};
use cudarc::driver::{CudaContext, CudaStream, DevicePtr, DevicePtrMut};
use std::marker::PhantomData;
use std::sync::Arc;

/// N ranks on one GPU, one launch per collective.
///
/// Every call is ordered on the stream it is given; calls on different
/// streams are ordered after each other by the group. Kernel errors (a peer
/// timeout, only possible through [`VirtualGroup::launch_with_absent_ranks`]
/// here) are reported by [`VirtualGroup::check`], and every later call
/// refuses to run (a kernel raises a host mailbox, so this needs no device
/// sync: see [`VirtualGroup::poll`]).
pub struct VirtualGroup {
    core: Collective,
}

impl std::fmt::Debug for VirtualGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VirtualGroup")
            .field("world", &self.core.world)
            .field("device", &self.kernels().context().ordinal())
            .field("config", &self.core.config)
            .field("id", &self.core.id)
            .finish()
    }
}

/// The pointer table of `inputs` (one per rank) and the ranks' scratch
/// and signals.
pub(crate) fn table_of(inputs: impl Fn(usize) -> u64, own: &[(usize, RankBuffers)]) -> RankTable {
    let mut t = RankTable::default();
    for (r, b) in own {
        t.inputs[*r] = inputs(*r);
        t.scratch[*r] = b.scratch.ptr();
        t.signals[*r] = b.signal.ptr();
    }
    t
}

impl VirtualGroup {
    pub fn new(ctx: &Arc<CudaContext>, world: usize, config: Config) -> Result<Self> {
        check_world(world)?;
        config.validate().map_err(Error::Config)?;
        let config = Config {
            thresholds: machine::resolve_thresholds(
                &config.thresholds,
                ctx,
                Link::SameDevice,
                world,
            )?,
            ..config
        };
        let kernels = Kernels::for_context(ctx, config.kernel_image)?;
        kernels.prepare(world, true, config.threads_per_block)?;
        let own = (0..world)
            .map(|r| Ok((r, RankBuffers::new(ctx, &config, world)?)))
            .collect::<Result<Vec<_>>>()?;
        let staging = by_rank(own.iter().map(|(_, b)| b.staging.ptr()));
        let signals = by_rank(own.iter().map(|(_, b)| b.signal.ptr()));
        let t = table_of(|r| staging[r], &own);
        let member = Member::new(
            kernels,
            Ranks::All,
            staging,
            DeviceAlloc::from_value(ctx, &t)?,
        )?;
        Ok(VirtualGroup {
            core: Collective::new(world, config, Link::SameDevice, signals, vec![member], own),
        })
    }

    pub fn world(&self) -> usize {
        self.core.world
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
    pub fn kernels(&self) -> &Kernels {
        &self.core.members[0].kernels
    }

    /// Staged allreduce of `inputs[r]` into `outputs[r]` for every rank r
    /// (slices or views), ordered on `stream`. Returns the algorithm of the
    /// whole call. Messages above `Config::max_bytes` run in chunks.
    ///
    /// Kernel errors (a peer that never arrives) show later: [`Self::poll`]
    /// (no wait) and [`Self::check`] report them, and the next call refuses
    /// to run until `reset`.
    pub fn allreduce<T, I, O>(
        &self,
        stream: &Arc<CudaStream>,
        inputs: &[&I],
        outputs: &mut [O],
        algo: AlgoChoice,
    ) -> Result<Algorithm>
    where
        T: DeviceElement,
        I: DevicePtr<T>,
        O: DevicePtrMut<T>,
    {
        check_count("inputs", inputs.len(), self.world())?;
        check_count("outputs", outputs.len(), self.world())?;
        let count = count_of(
            T::DTYPE,
            inputs.iter().map(|i| i.len()),
            outputs.iter().map(|o| o.len()),
        )?;
        let ins: Vec<_> = inputs.iter().map(|s| s.device_ptr(stream)).collect();
        let outs: Vec<_> = outputs
            .iter_mut()
            .map(|s| s.device_ptr_mut(stream))
            .collect();
        let i: Vec<u64> = ins.iter().map(|p| p.0).collect();
        let o: Vec<u64> = outs.iter().map(|p| p.0).collect();
        // SAFETY: every pointer comes from a live slice or view of at least
        // `count` elements, guarded until the work is enqueued.
        let r = unsafe { self.allreduce_raw(stream, T::DTYPE, count, &i, &o, algo) };
        settle(r, (ins, outs), &[stream])
    }

    /// In-place allreduce: every rank's buffer is both input and output.
    ///
    /// Kernel errors (a peer that never arrives) show later: [`Self::poll`]
    /// (no wait) and [`Self::check`] report them, and the next call refuses
    /// to run until `reset`.
    pub fn allreduce_in_place<T, B>(
        &self,
        stream: &Arc<CudaStream>,
        buffers: &mut [B],
        algo: AlgoChoice,
    ) -> Result<Algorithm>
    where
        T: DeviceElement,
        B: DevicePtrMut<T>,
    {
        check_count("buffers", buffers.len(), self.world())?;
        let count = count_of(
            T::DTYPE,
            buffers.iter().map(|b| b.len()),
            std::iter::empty(),
        )?;
        let bufs: Vec<_> = buffers
            .iter_mut()
            .map(|s| s.device_ptr_mut(stream))
            .collect();
        let p: Vec<u64> = bufs.iter().map(|p| p.0).collect();
        // SAFETY: live buffers of `count` elements; inputs are staged, so
        // reading and writing the same buffer is allowed.
        let r = unsafe { self.allreduce_raw(stream, T::DTYPE, count, &p, &p, algo) };
        settle(r, bufs, &[stream])
    }

    /// [`VirtualGroup::allreduce`] on raw device pointers. Inputs are
    /// staged, so `outputs[r] == inputs[r]` (in place) is allowed.
    ///
    /// Kernel errors (a peer that never arrives) show later: [`Self::poll`]
    /// (no wait) and [`Self::check`] report them, and the next call refuses
    /// to run until `reset`.
    ///
    /// # Safety
    /// `inputs[r]` must be valid for reads and `outputs[r]` for writes of
    /// `count` elements of `dtype`, until the work on `stream` completes.
    pub unsafe fn allreduce_raw(
        &self,
        stream: &Arc<CudaStream>,
        dtype: Dtype,
        count: usize,
        inputs: &[u64],
        outputs: &[u64],
        algo: AlgoChoice,
    ) -> Result<Algorithm> {
        check_count("inputs", inputs.len(), self.world())?;
        check_count("outputs", outputs.len(), self.world())?;
        let (i, o) = (
            by_rank(inputs.iter().copied()),
            by_rank(outputs.iter().copied()),
        );
        // SAFETY: forwarded from the caller.
        unsafe { self.core.staged(&[stream], dtype, count, &i, &o, algo) }
    }

    /// Fused allreduce + residual add + RMSNorm for every rank r:
    /// `residual[r] = round(sum + residual[r])` (in place), `normed[r] =
    /// round(f32(residual[r]) * inv_rms(row) * gamma[r])`, rows of
    /// `gamma[r].len()` elements, with the exact operation order of
    /// docs/numerics.md (identical bits for one-stage and two-stage, any
    /// rows, any grid). Inputs are staged, so `normed` may be another
    /// rank's input; [`Self::allreduce_add_rmsnorm_in_place`] writes it over
    /// the inputs.
    #[allow(clippy::too_many_arguments)]
    pub fn allreduce_add_rmsnorm<T, I, R, G, O>(
        &self,
        stream: &Arc<CudaStream>,
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
        let one = std::slice::from_ref(stream);
        let b = NormBuffers::staged(self.world(), one, inputs, residual, gamma, eps, normed)?;
        // SAFETY: every pointer comes from a live slice or view holding
        // what `NormBuffers` checked, guarded until the work is enqueued.
        let r = unsafe {
            self.core.add_rmsnorm(
                &[stream],
                T::DTYPE,
                b.rows,
                b.hidden,
                eps,
                &b.ptrs,
                NormInputs::Staged,
                algo,
            )
        };
        settle(r, b, &[stream])
    }

    /// [`Self::allreduce_add_rmsnorm`] with the normed rows written over
    /// each rank's input `x[r]`.
    pub fn allreduce_add_rmsnorm_in_place<T, X, R, G>(
        &self,
        stream: &Arc<CudaStream>,
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
        let one = std::slice::from_ref(stream);
        let b = NormBuffers::in_place(self.world(), one, x, residual, gamma, eps)?;
        // SAFETY: live buffers holding what `NormBuffers` checked; inputs
        // are staged, so writing the normed rows over them is allowed.
        let r = unsafe {
            self.core.add_rmsnorm(
                &[stream],
                T::DTYPE,
                b.rows,
                b.hidden,
                eps,
                &b.ptrs,
                NormInputs::Staged,
                algo,
            )
        };
        settle(r, b, &[stream])
    }

    /// Allocates registered (zero-copy) input buffers of `len` elements per rank.
    pub fn alloc_registered<T: DeviceElement>(&self, len: usize) -> Result<RegisteredBuffers<T>> {
        let ctx = self.kernels().context();
        let bufs = (0..self.world())
            .map(|_| DeviceAlloc::zeroed(ctx, len * T::DTYPE.size()))
            .collect::<Result<Vec<_>>>()?;
        let t = table_of(|r| bufs[r].ptr(), &self.core.own);
        Ok(RegisteredBuffers {
            tables: vec![DeviceAlloc::from_value(ctx, &t)?],
            bufs,
            len,
            group: self.core.id,
            ctxs: vec![ctx.clone()],
            _t: PhantomData,
        })
    }

    /// Zero-copy allreduce of the first `count` elements of registered
    /// buffers into `outputs`. Not chunked: a two-stage larger than the
    /// scratch runs one-stage under `Auto` (same bits) and is refused when
    /// asked for explicitly (`ScratchTooSmall`).
    ///
    /// Kernel errors (a peer that never arrives) show later: [`Self::poll`]
    /// (no wait) and [`Self::check`] report them, and the next call refuses
    /// to run until `reset`.
    pub fn allreduce_registered<T, O>(
        &self,
        stream: &Arc<CudaStream>,
        reg: &RegisteredBuffers<T>,
        count: usize,
        outputs: &mut [O],
        algo: AlgoChoice,
    ) -> Result<Algorithm>
    where
        T: DeviceElement,
        O: DevicePtrMut<T>,
    {
        check_count("outputs", outputs.len(), self.world())?;
        count_of(
            T::DTYPE,
            std::iter::once(count),
            outputs.iter().map(|o| o.len()),
        )?;
        let outs: Vec<_> = outputs
            .iter_mut()
            .map(|s| s.device_ptr_mut(stream))
            .collect();
        let o = by_rank(outs.iter().map(|p| p.0));
        // SAFETY: every output holds >= count elements (checked above).
        let r = unsafe { self.core.registered(&[stream], reg, count, &o, algo) };
        settle(r, outs, &[stream])
    }

    /// [`Self::allreduce_registered`] with raw output pointers (one per
    /// rank): for callers whose outputs are not cudarc slices, and for
    /// graph capture with cudarc's event tracking on, where taking a
    /// slice's pointer waits for an event recorded before the capture
    /// (`Error::CaptureInvalidated`).
    ///
    /// # Safety
    /// `outputs[r]` must be valid for writes of `count` elements of `T`
    /// until the work on `stream` completes (for as long as a captured
    /// graph can be launched), and must not overlap the registered buffers.
    pub unsafe fn allreduce_registered_raw<T: DeviceElement>(
        &self,
        stream: &Arc<CudaStream>,
        reg: &RegisteredBuffers<T>,
        count: usize,
        outputs: &[u64],
        algo: AlgoChoice,
    ) -> Result<Algorithm> {
        check_count("outputs", outputs.len(), self.world())?;
        let o = by_rank(outputs.iter().copied());
        // SAFETY: forwarded from the caller.
        unsafe { self.core.registered(&[stream], reg, count, &o, algo) }
    }

    /// [`Self::allreduce_add_rmsnorm`] with zero-copy input: the first
    /// `count` elements (whole rows of `gamma[r].len()`) of each rank's
    /// registered buffer, written beforehand, read where they are (no
    /// staging copy; one launch, not chunked: an explicit two-stage whose
    /// rows do not fit the scratch is refused with `ScratchTooSmall`, and a
    /// push_ll whose rows do not fit its landing zone with `ZoneTooSmall`;
    /// `Auto` runs one-stage there). `residual[r]` updated in place,
    /// `normed[r]` written, as the staged call.
    #[allow(clippy::too_many_arguments)]
    pub fn allreduce_add_rmsnorm_registered<T, R, G, O>(
        &self,
        stream: &Arc<CudaStream>,
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
        let one = std::slice::from_ref(stream);
        let b =
            NormBuffers::registered(self.world(), one, reg, count, residual, gamma, eps, normed)?;
        // SAFETY: residuals, gammas and outputs are live slices or views
        // holding what `NormBuffers` checked, guarded until the work is
        // enqueued; they cannot overlap the registered buffers, which only
        // `reg` owns.
        let r = unsafe {
            self.core
                .add_rmsnorm_registered(&[stream], reg, b.rows, b.hidden, eps, &b.ptrs, algo)
        };
        settle(r, b, &[stream])
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

    /// Waits for `stream`, then reports any error the kernels recorded (a
    /// peer timeout). After an error the group is poisoned until `reset`.
    pub fn check(&self, stream: &Arc<CudaStream>) -> Result<()> {
        self.core.check(&[stream])
    }

    /// Brings every rank back to a clean state after an error: waits for the
    /// device, zeroes all signals (epochs and error records) and landing zones.
    pub fn reset(&self) -> Result<()> {
        self.core.reset()
    }

    /// For tests of long runs: moves every block's epoch of every rank
    /// `collectives` epochs on, as that many collectives that wrote no
    /// flag or landing zone would (a long stretch of push_ll calls or of
    /// launches of fewer blocks). Waits for the device.
    #[doc(hidden)]
    pub fn advance_epochs(&self, collectives: u32) -> Result<()> {
        self.core.advance_epochs(collectives)
    }

    /// Fault injection for your own tests: one collective in which the
    /// ranks in `absent_ranks` (a bit mask; rank r is bit r) leave at once,
    /// as dead peers would; the others wait for them until the timeout and
    /// record `PeerTimeout`, which [`VirtualGroup::check`] reports. Waits
    /// for the stream.
    pub fn launch_with_absent_ranks(
        &self,
        stream: &Arc<CudaStream>,
        absent_ranks: u32,
        dtype: Dtype,
        algorithm: Algorithm,
        count: usize,
    ) -> Result<()> {
        self.core.launch_with_faults(
            &[stream],
            Faults::absent(absent_ranks),
            dtype,
            algorithm,
            count,
        )?;
        stream.synchronize().during("cuStreamSynchronize")
    }

    /// Fault injection for the fused call, as [`VirtualGroup::launch_with_absent_ranks`]
    /// for the allreduce: one fused allreduce + residual add + RMSNorm of
    /// `rows x hidden` elements of `dtype` with `algorithm` over the
    /// group's own buffers, in which the ranks in `absent_ranks` leave at
    /// once; the others wait for them until the timeout and record
    /// `PeerTimeout`, which [`VirtualGroup::check`] reports. Returns the
    /// algorithm that ran (the plan's, refusals as for the fused call:
    /// `rows * hidden` must fit `Config::max_bytes`). Waits for the stream.
    pub fn add_rmsnorm_with_absent_ranks(
        &self,
        stream: &Arc<CudaStream>,
        absent_ranks: u32,
        dtype: Dtype,
        algorithm: AlgoChoice,
        rows: usize,
        hidden: usize,
    ) -> Result<Algorithm> {
        let faults = Faults::absent(absent_ranks);
        self.add_rmsnorm_with_faults(stream, faults, dtype, algorithm, rows, hidden)
    }

    /// Fault injection for your own tests: one collective in which the
    /// ranks in `mismatched_ranks` (bit r: rank r) carry another call's
    /// tag, as ranks whose call differs from the others' would; the ranks
    /// wait for words of their own call until the timeout and record
    /// `CallMismatch` (or `PeerTimeout` where they saw no word of another
    /// call), which [`VirtualGroup::check`] reports. Does not wait, so a
    /// CUDA graph can capture it.
    pub fn launch_with_mismatched_ranks(
        &self,
        stream: &Arc<CudaStream>,
        mismatched_ranks: u32,
        dtype: Dtype,
        algorithm: Algorithm,
        count: usize,
    ) -> Result<()> {
        let faults = Faults::mismatched(mismatched_ranks);
        self.core
            .launch_with_faults(&[stream], faults, dtype, algorithm, count)
    }

    /// The fused call's [`Self::launch_with_mismatched_ranks`], as
    /// [`Self::add_rmsnorm_with_absent_ranks`]. Waits for the stream.
    pub fn add_rmsnorm_with_mismatched_ranks(
        &self,
        stream: &Arc<CudaStream>,
        mismatched_ranks: u32,
        dtype: Dtype,
        algorithm: AlgoChoice,
        rows: usize,
        hidden: usize,
    ) -> Result<Algorithm> {
        let faults = Faults::mismatched(mismatched_ranks);
        self.add_rmsnorm_with_faults(stream, faults, dtype, algorithm, rows, hidden)
    }

    /// The fused fault injection of both kinds, then a wait for the stream.
    fn add_rmsnorm_with_faults(
        &self,
        stream: &Arc<CudaStream>,
        faults: Faults,
        dtype: Dtype,
        algorithm: AlgoChoice,
        rows: usize,
        hidden: usize,
    ) -> Result<Algorithm> {
        let used =
            self.core
                .add_rmsnorm_with_faults(&[stream], faults, dtype, rows, hidden, algorithm)?;
        stream.synchronize().during("cuStreamSynchronize")?;
        Ok(used)
    }
}

const _: () = assert!(MAX_RANKS <= 32, "absent_ranks is a u32 bit mask");
