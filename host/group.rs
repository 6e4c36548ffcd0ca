//! Groups of ranks and the allreduce call.
//!
//! - [`VirtualGroup`]: N ranks on one GPU in one process; one launch runs all
//!   ranks (rank = `blockIdx.y`). This is how one GPU tests the real kernels
//!   and the real barrier protocol.
//! - [`PeerGroup`]: one rank per context in one process (several GPUs with
//!   peer access, or several ranks on one GPU), one launch per rank on that
//!   rank's stream.
//!
//! Inputs are either staged (copied into the rank's staging buffer on the
//! stream first; any buffer, any alignment, in place allowed) or registered
//! (buffers the group owns and peers read directly; zero copy).

use crate::abi::{
    error_code, Algorithm, BarrierKind, Dtype, ErrorRecord, LaunchArgs, RankTable, Signal,
    BUFFER_ALIGN, MAX_RANKS,
};
use crate::driver::{DeviceAlloc, Kernels};
use crate::error::{Context as _, Error, Result};
use crate::plan::{blocks_for, AlgoChoice, Config, Link};
use crate::ptx::Entry;
use cudarc::driver::{
    result, sys, CudaContext, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr,
};
use std::ffi::c_void;
use std::marker::PhantomData;
use std::sync::{Arc, Mutex};

/// Element types with kernels: `f32`, `half::f16`, `half::bf16`.
pub trait DeviceElement: DeviceRepr + cudarc::driver::ValidAsZeroBits + Copy + 'static {
    const DTYPE: Dtype;
}
impl DeviceElement for f32 {
    const DTYPE: Dtype = Dtype::F32;
}
impl DeviceElement for half::f16 {
    const DTYPE: Dtype = Dtype::F16;
}
impl DeviceElement for half::bf16 {
    const DTYPE: Dtype = Dtype::Bf16;
}

/// Element types that both the kernels and (with the `nccl` feature) NCCL take.
#[cfg(feature = "nccl")]
pub trait RoutedElement: DeviceElement + cudarc::nccl::NcclType {}
#[cfg(feature = "nccl")]
impl<T: DeviceElement + cudarc::nccl::NcclType> RoutedElement for T {}
/// Element types that both the kernels and (with the `nccl` feature) NCCL take.
#[cfg(not(feature = "nccl"))]
pub trait RoutedElement: DeviceElement {}
#[cfg(not(feature = "nccl"))]
impl<T: DeviceElement> RoutedElement for T {}

/// One rank's group-owned memory.
pub(crate) struct RankBuffers {
    pub(crate) staging: DeviceAlloc,
    pub(crate) scratch: DeviceAlloc,
    pub(crate) signal: DeviceAlloc,
}

impl RankBuffers {
    pub(crate) fn new(ctx: &Arc<CudaContext>, bytes: usize) -> Result<Self> {
        Ok(RankBuffers {
            staging: DeviceAlloc::zeroed(ctx, bytes)?,
            scratch: DeviceAlloc::zeroed(ctx, bytes)?,
            signal: DeviceAlloc::zeroed(ctx, std::mem::size_of::<Signal>())?,
        })
    }
}

pub(crate) fn check_world(world: usize) -> Result<()> {
    if world == 0 || world > MAX_RANKS {
        return Err(Error::WorldSize(world));
    }
    Ok(())
}

pub(crate) fn check_count(what: &'static str, got: usize, world: usize) -> Result<()> {
    if got != world {
        return Err(Error::RankCount { what, got, world });
    }
    Ok(())
}

pub(crate) fn check_aligned(what: &'static str, rank: usize, ptr: u64) -> Result<()> {
    if ptr % BUFFER_ALIGN as u64 != 0 {
        return Err(Error::Misaligned {
            what,
            rank,
            ptr,
            align: BUFFER_ALIGN,
        });
    }
    Ok(())
}

fn table(inputs: impl Fn(usize) -> u64, bufs: &[&RankBuffers]) -> RankTable {
    let mut t = RankTable::default();
    for (r, b) in bufs.iter().enumerate() {
        t.inputs[r] = inputs(r);
        t.scratch[r] = b.scratch.ptr();
    }
    t
}

/// The signal pointers every launch passes by value.
fn signal_ptrs(bufs: &[&RankBuffers]) -> [u64; MAX_RANKS] {
    let mut s = [0u64; MAX_RANKS];
    for (r, b) in bufs.iter().enumerate() {
        s[r] = b.signal.ptr();
    }
    s
}

/// Reads every rank's error record and turns the first one into an error.
pub(crate) fn read_error_records(signals: &[&DeviceAlloc]) -> Result<()> {
    for (position, sig) in signals.iter().enumerate() {
        let mut words = [0u32; Signal::ERROR_OFFSET / 4 + 8];
        sig.read(&mut words)?;
        let w = &words[Signal::ERROR_OFFSET / 4..];
        let rec = ErrorRecord {
            code: w[0],
            rank: w[1],
            block: w[2],
            peer: w[3],
            epoch: w[4],
            barrier: w[5],
            _reserved: [0; 2],
        };
        match rec.code {
            error_code::NONE => {}
            error_code::PEER_TIMEOUT => {
                return Err(Error::PeerTimeout {
                    rank: rec.rank as usize,
                    block: rec.block,
                    peer: rec.peer,
                    barrier: BarrierKind::from_u32(rec.barrier).unwrap_or(BarrierKind::Start),
                    epoch: rec.epoch,
                })
            }
            error_code::BAD_LAUNCH => {
                return Err(Error::BadLaunch {
                    rank: rec.rank as usize,
                    block: rec.block,
                })
            }
            error_code::UNREGISTERED => {
                return Err(Error::Unregistered {
                    rank: rec.rank as usize,
                })
            }
            code => {
                return Err(Error::UnknownKernelError {
                    rank: position,
                    code,
                })
            }
        }
    }
    Ok(())
}

/// Launches `entry` with one by-value [`LaunchArgs`].
///
/// # Safety
/// Every pointer in `args` (and in the table it points to) must be valid
/// device memory of the sizes the kernel will touch for `args.count`.
pub(crate) unsafe fn launch(
    kernels: &Kernels,
    stream: &CudaStream,
    entry: Entry,
    grid: (u32, u32),
    threads: u32,
    args: &LaunchArgs,
) -> Result<()> {
    let f = kernels.function(entry)?;
    let mut params = [args as *const LaunchArgs as *mut c_void];
    // SAFETY: `f` takes exactly one parameter of LaunchArgs' size and layout
    // (asserted in abi.rs and checked against the PTX by tests/ptx.rs); the
    // driver copies the parameter bytes before returning.
    unsafe {
        result::launch_kernel(
            f,
            (grid.0, grid.1, 1),
            (threads, 1, 1),
            0,
            stream.cu_stream(),
            &mut params,
        )
    }
    .during("cuLaunchKernel")
}

/// Shared state checks of both group kinds.
pub(crate) struct Health(Mutex<Option<String>>);

impl Health {
    pub(crate) fn new() -> Self {
        Health(Mutex::new(None))
    }
    pub(crate) fn ensure_ok(&self) -> Result<()> {
        match &*self.0.lock().unwrap_or_else(|p| p.into_inner()) {
            Some(why) => Err(Error::Poisoned(why.clone())),
            None => Ok(()),
        }
    }
    pub(crate) fn poison(&self, e: &Error) {
        *self.0.lock().unwrap_or_else(|p| p.into_inner()) = Some(e.to_string());
    }
    pub(crate) fn clear(&self) {
        *self.0.lock().unwrap_or_else(|p| p.into_inner()) = None;
    }
}

/// `(offset, len)` in elements of the collectives a message of `count`
/// elements is cut into: at most `capacity_bytes` each, rounded down to
/// whole packs so every chunk boundary stays 16-byte aligned. An empty
/// message is one empty collective (every rank still meets the others).
pub(crate) fn chunks(
    count: usize,
    dtype: Dtype,
    capacity_bytes: usize,
) -> impl Iterator<Item = (usize, usize)> {
    let chunk = ((capacity_bytes / crate::abi::PACK_BYTES) * dtype.lanes()).max(1);
    let n_chunks = count.div_ceil(chunk).max(1);
    (0..n_chunks).map(move |k| (k * chunk, (count - k * chunk).min(chunk)))
}

/// Copies elements `[offset, offset + len)` of `src` to the start of a
/// staging buffer, ordered on `stream`.
///
/// # Safety
/// `src` must hold `offset + len` elements of `size` bytes and `staging` at
/// least `len`.
pub(crate) unsafe fn stage(
    staging: u64,
    src: u64,
    offset: usize,
    len: usize,
    size: usize,
    stream: &CudaStream,
) -> Result<()> {
    if len == 0 {
        return Ok(());
    }
    // SAFETY: forwarded from the caller.
    unsafe {
        result::memcpy_dtod_async(
            staging,
            src + (offset * size) as u64,
            len * size,
            stream.cu_stream(),
        )
    }
    .during("cuMemcpyDtoDAsync (staging)")
}

/// The entry point and the blocks per rank for one collective; every rank
/// computes the same values from the same arguments, as the barriers need.
fn launch_shape(
    c: &Config,
    algo: Algorithm,
    dtype: Dtype,
    count: usize,
    world: usize,
    virtual_ranks: bool,
) -> (Entry, u32) {
    let entry = Entry {
        algorithm: algo,
        dtype,
        world,
        virtual_ranks,
    };
    (
        entry,
        blocks_for(algo, dtype, count, world, c.threads_per_block, c.max_blocks),
    )
}

/// What one real rank (not virtual) needs to launch its kernel: shared by
/// [`PeerGroup`] and [`crate::ProcessGroup`].
pub(crate) struct RankLaunch<'a> {
    pub kernels: &'a Kernels,
    pub config: &'a Config,
    pub world: usize,
    pub rank: usize,
    pub table: u64,
    pub signals: [u64; MAX_RANKS],
}

impl RankLaunch<'_> {
    /// # Safety
    /// The table and signals must point at live buffers of this group and
    /// `output` must be valid for `count` writes of `dtype`.
    pub(crate) unsafe fn launch(
        &self,
        stream: &CudaStream,
        dtype: Dtype,
        count: usize,
        output: u64,
        algo: Algorithm,
    ) -> Result<()> {
        let c = self.config;
        let (entry, blocks) = launch_shape(c, algo, dtype, count, self.world, false);
        let mut args = LaunchArgs {
            table: self.table,
            signals: self.signals,
            count: count as u64,
            timeout_ns: c.timeout_ns(),
            rank: self.rank as u32,
            ..Default::default()
        };
        args.outputs[self.rank] = output;
        // SAFETY: forwarded from the caller.
        unsafe {
            launch(
                self.kernels,
                stream,
                entry,
                (blocks, 1),
                c.threads_per_block,
                &args,
            )
        }
    }
}

/// Registered (zero-copy) input buffers, one per rank, owned by this value.
/// Peers read them directly, so the collective needs no copy. Write your
/// data into `ptr(rank)` (e.g. as the output of your own kernel) before the
/// allreduce on the same stream.
pub struct RegisteredBuffers<T: DeviceElement> {
    bufs: Vec<DeviceAlloc>,
    /// One table per owning rank (virtual groups use only the first).
    tables: Vec<DeviceAlloc>,
    len: usize,
    ctxs: Vec<Arc<CudaContext>>,
    _t: PhantomData<T>,
}

impl<T: DeviceElement> RegisteredBuffers<T> {
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Device pointer of rank `rank`'s buffer (16-byte aligned).
    ///
    /// # Panics
    /// If `rank` is not below the group's world size, like slice indexing.
    pub fn ptr(&self, rank: usize) -> u64 {
        self.bufs[rank].ptr()
    }
    /// Copies `src` into rank `rank`'s buffer, ordered on `stream`.
    pub fn copy_from(
        &self,
        rank: usize,
        stream: &Arc<CudaStream>,
        src: &CudaSlice<T>,
    ) -> Result<()> {
        if rank >= self.bufs.len() {
            return Err(Error::RankCount {
                what: "rank index (registered buffer)",
                got: rank,
                world: self.bufs.len(),
            });
        }
        if src.len() > self.len {
            return Err(Error::BufferTooSmall {
                what: "registered buffer",
                rank,
                len: self.len,
                need: src.len(),
            });
        }
        let (p, _g) = src.device_ptr(stream);
        // SAFETY: both ranges are live device memory of at least src.len() elements.
        unsafe {
            result::memcpy_dtod_async(
                self.bufs[rank].ptr(),
                p,
                src.len() * Dtype::size(T::DTYPE),
                stream.cu_stream(),
            )
        }
        .during("cuMemcpyDtoDAsync (registered input)")
    }
}

impl<T: DeviceElement> Drop for RegisteredBuffers<T> {
    fn drop(&mut self) {
        // A kernel still in flight may read these buffers: wait for the
        // devices before the allocations are freed.
        for c in &self.ctxs {
            let _ = c.synchronize();
        }
    }
}

// ---------------------------------------------------------------------------

/// N ranks on one GPU, one launch per collective.
pub struct VirtualGroup {
    world: usize,
    config: Config,
    kernels: Arc<Kernels>,
    ranks: Vec<RankBuffers>,
    signals: [u64; MAX_RANKS],
    staged_table: DeviceAlloc,
    health: Health,
}

impl VirtualGroup {
    pub fn new(ctx: &Arc<CudaContext>, world: usize, config: Config) -> Result<Self> {
        check_world(world)?;
        config.validate().map_err(Error::Config)?;
        let kernels = Kernels::for_context(ctx)?;
        let ranks = (0..world)
            .map(|_| RankBuffers::new(ctx, config.max_bytes))
            .collect::<Result<Vec<_>>>()?;
        let refs: Vec<&RankBuffers> = ranks.iter().collect();
        let t = table(|r| ranks[r].staging.ptr(), &refs);
        let signals = signal_ptrs(&refs);
        let staged_table = DeviceAlloc::from_value(ctx, &t)?;
        Ok(VirtualGroup {
            world,
            config,
            kernels,
            ranks,
            signals,
            staged_table,
            health: Health::new(),
        })
    }

    pub fn world(&self) -> usize {
        self.world
    }
    pub fn config(&self) -> &Config {
        &self.config
    }
    pub fn kernels(&self) -> &Kernels {
        &self.kernels
    }

    /// Staged allreduce of `inputs[r]` into `outputs[r]` for every rank r,
    /// ordered on `stream`. Returns the algorithm used. Errors found by the
    /// kernels (a peer timeout) are reported by [`VirtualGroup::check`].
    pub fn allreduce<T: DeviceElement>(
        &self,
        stream: &Arc<CudaStream>,
        inputs: &[&CudaSlice<T>],
        outputs: &mut [CudaSlice<T>],
        algo: AlgoChoice,
    ) -> Result<Algorithm> {
        check_count("inputs", inputs.len(), self.world)?;
        check_count("outputs", outputs.len(), self.world)?;
        let count = inputs[0].len();
        for (r, (i, o)) in inputs.iter().zip(outputs.iter()).enumerate() {
            if i.len() != count {
                return Err(Error::RankMismatch {
                    rank: r,
                    dtype: T::DTYPE,
                    count: i.len(),
                    dtype0: T::DTYPE,
                    count0: count,
                });
            }
            if o.len() < count {
                return Err(Error::BufferTooSmall {
                    what: "output",
                    rank: r,
                    len: o.len(),
                    need: count,
                });
            }
        }
        let ins: Vec<_> = inputs.iter().map(|s| s.device_ptr(stream)).collect();
        let outs: Vec<_> = outputs
            .iter_mut()
            .map(|s| s.device_ptr_mut(stream))
            .collect();
        let in_ptrs: Vec<u64> = ins.iter().map(|p| p.0).collect();
        let out_ptrs: Vec<u64> = outs.iter().map(|p| p.0).collect();
        // SAFETY: every pointer comes from a live CudaSlice of at least `count` elements.
        unsafe { self.allreduce_raw(stream, T::DTYPE, count, &in_ptrs, &out_ptrs, algo) }
    }

    /// [`VirtualGroup::allreduce`] on raw device pointers.
    ///
    /// # Safety
    /// `inputs[r]` must be valid for reads and `outputs[r]` for writes of
    /// `count` elements of `dtype`, until the work on `stream` completes.
    pub unsafe fn allreduce_raw(
        &self,
        stream: &CudaStream,
        dtype: Dtype,
        count: usize,
        inputs: &[u64],
        outputs: &[u64],
        algo: AlgoChoice,
    ) -> Result<Algorithm> {
        self.health.ensure_ok()?;
        check_count("inputs", inputs.len(), self.world)?;
        check_count("outputs", outputs.len(), self.world)?;
        for (r, &o) in outputs.iter().enumerate() {
            check_aligned("output", r, o)?;
        }
        let size = dtype.size();
        let bytes = count * size;
        if bytes > self.config.max_bytes && !self.config.chunking {
            return Err(Error::MessageTooLarge {
                bytes,
                capacity: self.config.max_bytes,
            });
        }
        let mut used = Algorithm::OneStage;
        for (off, n) in chunks(count, dtype, self.config.max_bytes) {
            for (r, &i) in inputs.iter().enumerate() {
                // SAFETY: caller guarantees inputs[r] holds `count` elements;
                // staging holds max_bytes >= n * size.
                unsafe { stage(self.ranks[r].staging.ptr(), i, off, n, size, stream)? };
            }
            let outs: Vec<u64> = outputs.iter().map(|&o| o + (off * size) as u64).collect();
            used = self
                .config
                .thresholds
                .choose(algo, n * size, self.world, Link::SameDevice);
            // SAFETY: staging/scratch/signals are this group's live buffers,
            // the outputs are valid per the caller's contract.
            unsafe { self.launch(stream, self.staged_table.ptr(), dtype, n, &outs, used, 0)? };
        }
        Ok(used)
    }

    /// Allocates registered (zero-copy) input buffers of `len` elements per rank.
    pub fn alloc_registered<T: DeviceElement>(&self, len: usize) -> Result<RegisteredBuffers<T>> {
        let ctx = self.kernels.context();
        let bufs = (0..self.world)
            .map(|_| DeviceAlloc::zeroed(ctx, len * T::DTYPE.size()))
            .collect::<Result<Vec<_>>>()?;
        let refs: Vec<&RankBuffers> = self.ranks.iter().collect();
        let t = table(|r| bufs[r].ptr(), &refs);
        let tab = DeviceAlloc::from_value(ctx, &t)?;
        Ok(RegisteredBuffers {
            bufs,
            tables: vec![tab],
            len,
            ctxs: vec![ctx.clone()],
            _t: PhantomData,
        })
    }

    /// Allreduce of the first `count` elements of registered buffers into
    /// `outputs`. Messages larger than the scratch buffers run one-stage
    /// (which needs no scratch and gives the same bits).
    pub fn allreduce_registered<T: DeviceElement>(
        &self,
        stream: &Arc<CudaStream>,
        reg: &RegisteredBuffers<T>,
        count: usize,
        outputs: &mut [CudaSlice<T>],
        algo: AlgoChoice,
    ) -> Result<Algorithm> {
        self.health.ensure_ok()?;
        check_count("outputs", outputs.len(), self.world)?;
        check_count("registered buffers", reg.bufs.len(), self.world)?;
        if count > reg.len {
            return Err(Error::BufferTooSmall {
                what: "registered buffer",
                rank: 0,
                len: reg.len,
                need: count,
            });
        }
        let mut outs = Vec::with_capacity(self.world);
        for (r, o) in outputs.iter_mut().enumerate() {
            if o.len() < count {
                return Err(Error::BufferTooSmall {
                    what: "output",
                    rank: r,
                    len: o.len(),
                    need: count,
                });
            }
            let (p, g) = o.device_ptr_mut(stream);
            check_aligned("output", r, p)?;
            outs.push((p, g));
        }
        let out_ptrs: Vec<u64> = outs.iter().map(|p| p.0).collect();
        let bytes = count * T::DTYPE.size();
        let mut used = self
            .config
            .thresholds
            .choose(algo, bytes, self.world, Link::SameDevice);
        if used == Algorithm::TwoStage && bytes > self.config.max_bytes {
            used = Algorithm::OneStage;
        }
        // SAFETY: registered buffers hold >= count elements; outputs checked above.
        unsafe {
            self.launch(
                stream,
                reg.tables[0].ptr(),
                T::DTYPE,
                count,
                &out_ptrs,
                used,
                0,
            )?
        };
        Ok(used)
    }

    /// # Safety
    /// `table` must point to a RankTable whose inputs hold `count` elements
    /// (and scratch enough for two-stage), `outputs` valid for `count` writes.
    #[allow(clippy::too_many_arguments)] // one per kernel argument; a struct would only rename them
    unsafe fn launch(
        &self,
        stream: &CudaStream,
        table: u64,
        dtype: Dtype,
        count: usize,
        outputs: &[u64],
        algo: Algorithm,
        absent_ranks: u32,
    ) -> Result<()> {
        let c = &self.config;
        let (entry, blocks) = launch_shape(c, algo, dtype, count, self.world, true);
        let capacity = self
            .kernels
            .co_resident_blocks(entry, c.threads_per_block)?;
        let total = blocks * self.world as u32;
        if total > capacity {
            return Err(Error::NotCoResident {
                blocks: total,
                threads: c.threads_per_block,
                capacity,
            });
        }
        let mut args = LaunchArgs {
            table,
            signals: self.signals,
            count: count as u64,
            timeout_ns: c.timeout_ns(),
            absent_ranks,
            ..Default::default()
        };
        args.outputs[..outputs.len()].copy_from_slice(outputs);
        // SAFETY: forwarded from the caller.
        unsafe {
            launch(
                &self.kernels,
                stream,
                entry,
                (blocks, self.world as u32),
                c.threads_per_block,
                &args,
            )
        }
    }

    /// Waits for `stream`, then reports any error the kernels recorded (a
    /// peer timeout). After an error the group is poisoned until `reset`.
    pub fn check(&self, stream: &CudaStream) -> Result<()> {
        stream.synchronize().during("cuStreamSynchronize")?;
        let sigs: Vec<&DeviceAlloc> = self.ranks.iter().map(|r| &r.signal).collect();
        read_error_records(&sigs).inspect_err(|e| self.health.poison(e))
    }

    /// Brings every rank back to a clean state after an error: waits for the
    /// device, zeroes all signals (epochs and error records).
    pub fn reset(&self) -> Result<()> {
        self.kernels
            .context()
            .synchronize()
            .during("cuCtxSynchronize")?;
        for r in &self.ranks {
            r.signal.write(&[0u8; std::mem::size_of::<Signal>()])?;
        }
        self.health.clear();
        Ok(())
    }

    /// Fault injection for tests: a one-stage f32 collective over the
    /// staging buffers in which the ranks in `absent_ranks` (a bit mask)
    /// leave at once, as dead peers would. The present ranks must report a
    /// timeout through [`VirtualGroup::check`].
    #[doc(hidden)]
    pub fn launch_with_absent_ranks(
        &self,
        stream: &Arc<CudaStream>,
        absent_ranks: u32,
        count: usize,
    ) -> Result<()> {
        let count = count.min(self.config.max_bytes / 4);
        let out = DeviceAlloc::zeroed(self.kernels.context(), count * 4)?;
        let outs = vec![out.ptr(); self.world];
        // SAFETY: staging holds max_bytes >= count * 4; `out` holds count f32
        // (all ranks write the same values to it, which is harmless here).
        unsafe {
            self.launch(
                stream,
                self.staged_table.ptr(),
                Dtype::F32,
                count,
                &outs,
                Algorithm::OneStage,
                absent_ranks,
            )?
        };
        stream.synchronize().during("cuStreamSynchronize")?;
        Ok(())
    }
}

// ---------------------------------------------------------------------------

/// One rank per context in one process: several GPUs with peer access, or
/// several ranks sharing a GPU (each launch on its own stream).
pub struct PeerGroup {
    world: usize,
    signals: [u64; MAX_RANKS],
    config: Config,
    link: Link,
    ranks: Vec<PeerRank>,
    health: Health,
    #[cfg(feature = "nccl")]
    nccl: Option<crate::nccl::NcclGroup>,
}

/// Which path a routed allreduce took.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Route {
    Kernel(Algorithm),
    Nccl,
}

struct PeerRank {
    kernels: Arc<Kernels>,
    bufs: RankBuffers,
    staged_table: DeviceAlloc,
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
                let l = crate::topology::link_between(ca, cb)?.ok_or(Error::NoPeerAccess {
                    a: ca.ordinal(),
                    b: cb.ordinal(),
                })?;
                link = crate::topology::slowest(link, l);
                ca.bind_to_thread().during("cuCtxSetCurrent")?;
                // SAFETY: both contexts are live; "already enabled" is not an error for us.
                let r = unsafe { sys::cuCtxEnablePeerAccess(cb.cu_ctx(), 0) };
                if r != sys::CUresult::CUDA_SUCCESS
                    && r != sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED
                {
                    r.result().during("cuCtxEnablePeerAccess")?;
                }
            }
        }
        let mut ranks = Vec::with_capacity(world);
        for ctx in contexts {
            ranks.push((
                Kernels::for_context(ctx)?,
                RankBuffers::new(ctx, config.max_bytes)?,
            ));
        }
        let refs: Vec<&RankBuffers> = ranks.iter().map(|(_, b)| b).collect();
        let t = table(|r| refs[r].staging.ptr(), &refs);
        let signals = signal_ptrs(&refs);
        let mut out = Vec::with_capacity(world);
        for (ctx, (kernels, bufs)) in contexts.iter().zip(ranks) {
            let staged_table = DeviceAlloc::from_value(ctx, &t)?;
            out.push(PeerRank {
                kernels,
                bufs,
                staged_table,
            });
        }
        Ok(PeerGroup {
            world,
            signals,
            config,
            link,
            ranks: out,
            health: Health::new(),
            #[cfg(feature = "nccl")]
            nccl: None,
        })
    }

    /// Creates NCCL communicators over `streams` (one per rank, distinct
    /// GPUs), so that [`PeerGroup::allreduce_routed`] can hand messages
    /// above `Config::nccl_above` to NCCL.
    #[cfg(feature = "nccl")]
    pub fn enable_nccl(&mut self, streams: &[Arc<CudaStream>]) -> Result<()> {
        check_count("streams", streams.len(), self.world)?;
        self.nccl = Some(crate::nccl::NcclGroup::new(streams)?);
        Ok(())
    }

    /// [`PeerGroup::allreduce`], except that under `AlgoChoice::Auto` a
    /// message larger than `Config::nccl_above` goes to NCCL when it was
    /// enabled. Without the `nccl` feature this is `allreduce`.
    pub fn allreduce_routed<T: RoutedElement>(
        &self,
        streams: &[Arc<CudaStream>],
        inputs: &[&CudaSlice<T>],
        outputs: &mut [CudaSlice<T>],
        algo: AlgoChoice,
    ) -> Result<Route> {
        #[cfg(feature = "nccl")]
        if let (Some(n), Some(above), AlgoChoice::Auto) = (&self.nccl, self.config.nccl_above, algo)
        {
            let bytes = inputs.first().map_or(0, |i| i.len() * T::DTYPE.size());
            if bytes > above {
                self.health.ensure_ok()?;
                n.allreduce(inputs, outputs)?;
                return Ok(Route::Nccl);
            }
        }
        self.allreduce(streams, inputs, outputs, algo)
            .map(Route::Kernel)
    }

    pub fn world(&self) -> usize {
        self.world
    }
    pub fn link(&self) -> Link {
        self.link
    }

    /// Staged allreduce: rank r copies `inputs[r]` into its staging buffer and
    /// launches on `streams[r]`. Returns the algorithm used.
    pub fn allreduce<T: DeviceElement>(
        &self,
        streams: &[Arc<CudaStream>],
        inputs: &[&CudaSlice<T>],
        outputs: &mut [CudaSlice<T>],
        algo: AlgoChoice,
    ) -> Result<Algorithm> {
        self.health.ensure_ok()?;
        check_count("streams", streams.len(), self.world)?;
        check_count("inputs", inputs.len(), self.world)?;
        check_count("outputs", outputs.len(), self.world)?;
        let count = inputs[0].len();
        let size = T::DTYPE.size();
        let bytes = count * size;
        if bytes > self.config.max_bytes && !self.config.chunking {
            return Err(Error::MessageTooLarge {
                bytes,
                capacity: self.config.max_bytes,
            });
        }
        let mut ins = Vec::new();
        let mut outs = Vec::new();
        for r in 0..self.world {
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
        for (r, (i, o)) in inputs.iter().zip(outputs.iter_mut()).enumerate() {
            ins.push(i.device_ptr(&streams[r]));
            let p = o.device_ptr_mut(&streams[r]);
            check_aligned("output", r, p.0)?;
            outs.push(p);
        }
        let mut used = Algorithm::OneStage;
        for (off, n) in chunks(count, T::DTYPE, self.config.max_bytes) {
            used = self
                .config
                .thresholds
                .choose(algo, n * size, self.world, self.link);
            for (r, rank) in self.ranks.iter().enumerate() {
                let l = RankLaunch {
                    kernels: &rank.kernels,
                    config: &self.config,
                    world: self.world,
                    rank: r,
                    table: rank.staged_table.ptr(),
                    signals: self.signals,
                };
                // SAFETY: input holds `count` elements, staging holds
                // max_bytes >= n * size; table, scratch and signals are this
                // group's live buffers; the output holds `count` elements.
                unsafe {
                    stage(rank.bufs.staging.ptr(), ins[r].0, off, n, size, &streams[r])?;
                    l.launch(
                        &streams[r],
                        T::DTYPE,
                        n,
                        outs[r].0 + (off * size) as u64,
                        used,
                    )?;
                }
            }
        }
        Ok(used)
    }

    /// Waits for every rank's stream and reports recorded kernel errors.
    pub fn check(&self, streams: &[Arc<CudaStream>]) -> Result<()> {
        for s in streams {
            s.synchronize().during("cuStreamSynchronize")?;
        }
        let sigs: Vec<&DeviceAlloc> = self.ranks.iter().map(|r| &r.bufs.signal).collect();
        read_error_records(&sigs).inspect_err(|e| self.health.poison(e))
    }

    /// Zeroes every rank's signal after waiting for all devices.
    pub fn reset(&self) -> Result<()> {
        for r in &self.ranks {
            r.kernels
                .context()
                .synchronize()
                .during("cuCtxSynchronize")?;
        }
        for r in &self.ranks {
            r.bufs.signal.write(&[0u8; std::mem::size_of::<Signal>()])?;
        }
        self.health.clear();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_cover_the_message_on_pack_boundaries() {
        assert_eq!(chunks(0, Dtype::F32, 64).collect::<Vec<_>>(), vec![(0, 0)]);
        assert_eq!(
            chunks(10, Dtype::F32, 1 << 20).collect::<Vec<_>>(),
            vec![(0, 10)]
        );
        // 40 bytes of capacity hold two whole f32 packs: 8 elements.
        assert_eq!(
            chunks(20, Dtype::F32, 40).collect::<Vec<_>>(),
            vec![(0, 8), (8, 8), (16, 4)]
        );
        for (count, dtype, cap) in [
            (1_000_003usize, Dtype::Bf16, 65_536usize),
            (77, Dtype::F16, 32),
            (64, Dtype::F32, 256),
        ] {
            let v: Vec<_> = chunks(count, dtype, cap).collect();
            let mut next = 0;
            for &(off, n) in &v {
                assert_eq!(off, next);
                assert_eq!(
                    (off * dtype.size()) % crate::abi::PACK_BYTES,
                    0,
                    "chunk starts off a pack boundary"
                );
                assert!(n * dtype.size() <= cap);
                next = off + n;
            }
            assert_eq!(next, count);
        }
    }
}
