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
use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr};
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

/// Element types that both the kernels and (with the `nccl` feature) NCCL
/// take: every [`DeviceElement`].
pub trait RoutedElement: DeviceElement {}
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
    // SAFETY: forwarded from the caller.
    unsafe {
        crate::driver::copy_dtod_async(stream, staging, src + (offset * size) as u64, len * size)
    }
}

/// The algorithm of a registered (unchunked) allreduce of `bytes` bytes.
/// Two-stage needs `bytes` of scratch per rank: `Auto` then runs one-stage
/// (same bits), an explicit `TwoStage` is refused.
pub(crate) fn registered_algorithm(
    c: &Config,
    algo: AlgoChoice,
    bytes: usize,
    world: usize,
    link: Link,
) -> Result<Algorithm> {
    let used = c.thresholds.choose(algo, bytes, world, link);
    if used == Algorithm::TwoStage && bytes > c.max_bytes {
        if algo == AlgoChoice::TwoStage {
            return Err(Error::ScratchTooSmall {
                bytes,
                capacity: c.max_bytes,
            });
        }
        return Ok(Algorithm::OneStage);
    }
    Ok(used)
}

/// The entry point and the blocks per rank for one collective; every rank
/// computes the same values from the same arguments, as the barriers need.
fn launch_shape(
    c: &Config,
    link: Link,
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
        blocks_for(
            algo,
            dtype,
            count,
            world,
            c.threads_per_block,
            c.blocks_cap(link),
        ),
    )
}

/// What one real rank (not virtual) needs to launch its kernel: shared by
/// [`PeerGroup`] and [`crate::ProcessGroup`].
pub(crate) struct RankLaunch<'a> {
    pub kernels: &'a Kernels,
    pub config: &'a Config,
    pub link: Link,
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
        let (entry, blocks) = launch_shape(c, self.link, algo, dtype, count, self.world, false);
        // Blocks of one rank that cannot all be resident would wait on
        // barriers that their peers' blocks of the same index hold.
        let capacity = self
            .kernels
            .co_resident_blocks(entry, c.threads_per_block)?;
        if blocks > capacity {
            return Err(Error::NotCoResident {
                blocks,
                threads: c.threads_per_block,
                capacity,
            });
        }
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
            self.kernels
                .launch(stream, entry, (blocks, 1), c.threads_per_block, &args)
        }
    }
}

/// A process-unique id per group, so that registered buffers are only
/// accepted by the group whose scratch and signals their tables point at.
pub(crate) fn next_group_id() -> u64 {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

/// Registered (zero-copy) input buffers, one per rank, owned by this value.
/// Peers read them directly, so the collective needs no copy. Write your
/// data into `ptr(rank)` (e.g. as the output of your own kernel) before the
/// allreduce on the same stream.
///
/// Their pointer tables name the scratch and signal buffers of the group
/// that allocated them, so only that group accepts them
/// (`Error::ForeignRegistered` otherwise).
pub struct RegisteredBuffers<T: DeviceElement> {
    bufs: Vec<DeviceAlloc>,
    /// One table per owning rank (virtual groups use only the first).
    tables: Vec<DeviceAlloc>,
    len: usize,
    group: u64,
    ctxs: Vec<Arc<CudaContext>>,
    _t: PhantomData<T>,
}

impl<T: DeviceElement> std::fmt::Debug for RegisteredBuffers<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RegisteredBuffers")
            .field("dtype", &T::DTYPE)
            .field("ranks", &self.bufs.len())
            .field("len", &self.len)
            .field("group", &self.group)
            .finish()
    }
}

impl<T: DeviceElement> RegisteredBuffers<T> {
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Number of ranks (one buffer each).
    pub fn ranks(&self) -> usize {
        self.bufs.len()
    }
    /// Device pointer of rank `rank`'s buffer (16-byte aligned), on that
    /// rank's device.
    ///
    /// # Panics
    /// If `rank >= self.ranks()`, like slice indexing.
    pub fn ptr(&self, rank: usize) -> u64 {
        assert!(
            rank < self.bufs.len(),
            "RegisteredBuffers::ptr: rank {rank} out of range for {} ranks",
            self.bufs.len()
        );
        self.bufs[rank].ptr()
    }
    pub(crate) fn check_owner(&self, group: u64) -> Result<()> {
        if self.group != group {
            return Err(Error::ForeignRegistered);
        }
        Ok(())
    }
    /// Copies `src` into rank `rank`'s buffer, ordered on `stream` (a
    /// stream of that rank's device).
    ///
    /// # Panics
    /// If `rank >= self.ranks()`, as [`RegisteredBuffers::ptr`].
    pub fn copy_from(
        &self,
        rank: usize,
        stream: &Arc<CudaStream>,
        src: &CudaSlice<T>,
    ) -> Result<()> {
        let dst = self.ptr(rank);
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
        unsafe { crate::driver::copy_dtod_async(stream, dst, p, src.len() * T::DTYPE.size()) }
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
    id: u64,
}

impl std::fmt::Debug for VirtualGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VirtualGroup")
            .field("world", &self.world)
            .field("device", &self.kernels.context().ordinal())
            .field("config", &self.config)
            .field("id", &self.id)
            .finish()
    }
}

impl VirtualGroup {
    pub fn new(ctx: &Arc<CudaContext>, world: usize, config: Config) -> Result<Self> {
        check_world(world)?;
        config.validate().map_err(Error::Config)?;
        let kernels = Kernels::for_context(ctx)?;
        kernels.prepare(world, true, config.threads_per_block)?;
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
            id: next_group_id(),
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
            group: self.id,
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
        reg.check_owner(self.id)?;
        check_count("outputs", outputs.len(), self.world)?;
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
        let used = registered_algorithm(
            &self.config,
            algo,
            count * T::DTYPE.size(),
            self.world,
            Link::SameDevice,
        )?;
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
        let (entry, blocks) =
            launch_shape(c, Link::SameDevice, algo, dtype, count, self.world, true);
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
            self.kernels.launch(
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
///
/// Every call takes one stream per rank (`streams[r]` on rank r's device)
/// and enqueues rank r's work on it; nothing waits on the host except
/// [`PeerGroup::check`]. Errors found by the kernels (a peer timeout) are
/// reported by `check`; until then later calls return `Ok`.
pub struct PeerGroup {
    world: usize,
    signals: [u64; MAX_RANKS],
    config: Config,
    link: Link,
    ranks: Vec<PeerRank>,
    health: Health,
    id: u64,
    #[cfg(feature = "nccl")]
    nccl: Option<crate::nccl::NcclGroup>,
}

impl std::fmt::Debug for PeerGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let devices: Vec<usize> = self
            .ranks
            .iter()
            .map(|r| r.kernels.context().ordinal())
            .collect();
        f.debug_struct("PeerGroup")
            .field("world", &self.world)
            .field("devices", &devices)
            .field("link", &self.link)
            .field("config", &self.config)
            .field("id", &self.id)
            .finish()
    }
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
                crate::driver::enable_peer_access(ca, cb)?;
            }
        }
        let mut ranks = Vec::with_capacity(world);
        for ctx in contexts {
            let kernels = Kernels::for_context(ctx)?;
            kernels.prepare(world, false, config.threads_per_block)?;
            ranks.push((kernels, RankBuffers::new(ctx, config.max_bytes)?));
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
            id: next_group_id(),
            #[cfg(feature = "nccl")]
            nccl: None,
        })
    }

    /// Creates NCCL communicators over `streams` (one per rank, distinct
    /// GPUs), so that [`PeerGroup::allreduce_routed`] can hand messages
    /// above `Config::nccl_above` to NCCL.
    #[cfg(feature = "nccl")]
    pub fn enable_nccl(&mut self, streams: &[Arc<CudaStream>]) -> Result<()> {
        self.check_streams(streams)?;
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
                n.allreduce(streams, inputs, outputs)?;
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
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// One stream per rank, each on its rank's device, no stream twice.
    fn check_streams(&self, streams: &[Arc<CudaStream>]) -> Result<()> {
        check_count("streams", streams.len(), self.world)?;
        for (r, s) in streams.iter().enumerate() {
            let want = self.ranks[r].kernels.context();
            if s.context().cu_ctx() != want.cu_ctx() {
                return Err(Error::StreamDevice {
                    rank: r,
                    stream_device: s.context().ordinal(),
                    rank_device: want.ordinal(),
                });
            }
            if let Some(a) = streams[..r]
                .iter()
                .position(|p| p.cu_stream() == s.cu_stream())
            {
                return Err(Error::SharedStream { a, b: r });
            }
        }
        Ok(())
    }

    fn rank_launch(&self, r: usize, table: u64) -> RankLaunch<'_> {
        RankLaunch {
            kernels: &self.ranks[r].kernels,
            config: &self.config,
            link: self.link,
            world: self.world,
            rank: r,
            table,
            signals: self.signals,
        }
    }

    /// Staged allreduce: rank r copies `inputs[r]` into its staging buffer and
    /// launches on `streams[r]`. Returns the algorithm used (of the last
    /// chunk, for messages above `Config::max_bytes`).
    pub fn allreduce<T: DeviceElement>(
        &self,
        streams: &[Arc<CudaStream>],
        inputs: &[&CudaSlice<T>],
        outputs: &mut [CudaSlice<T>],
        algo: AlgoChoice,
    ) -> Result<Algorithm> {
        self.check_streams(streams)?;
        check_count("inputs", inputs.len(), self.world)?;
        check_count("outputs", outputs.len(), self.world)?;
        let count = inputs[0].len();
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
        let mut ins = Vec::with_capacity(self.world);
        let mut outs = Vec::with_capacity(self.world);
        for (r, (i, o)) in inputs.iter().zip(outputs.iter_mut()).enumerate() {
            ins.push(i.device_ptr(&streams[r]));
            outs.push(o.device_ptr_mut(&streams[r]));
        }
        let in_ptrs: Vec<u64> = ins.iter().map(|p| p.0).collect();
        let out_ptrs: Vec<u64> = outs.iter().map(|p| p.0).collect();
        // SAFETY: every pointer comes from a live CudaSlice of at least
        // `count` elements on its rank's device, held until this returns
        // (the guards record the use on each rank's stream).
        unsafe { self.allreduce_raw(streams, T::DTYPE, count, &in_ptrs, &out_ptrs, algo) }
    }

    /// [`PeerGroup::allreduce`] on raw device pointers: `inputs[r]` and
    /// `outputs[r]` on rank r's device. Inputs are staged, so
    /// `outputs[r] == inputs[r]` (in place) is allowed.
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
        self.health.ensure_ok()?;
        self.check_streams(streams)?;
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
            used = self
                .config
                .thresholds
                .choose(algo, n * size, self.world, self.link);
            for (r, rank) in self.ranks.iter().enumerate() {
                let l = self.rank_launch(r, rank.staged_table.ptr());
                // SAFETY: inputs[r] holds `count` elements (caller), staging
                // holds max_bytes >= n * size; table, scratch and signals are
                // this group's live buffers; outputs[r] holds `count` elements.
                unsafe {
                    stage(
                        rank.bufs.staging.ptr(),
                        inputs[r],
                        off,
                        n,
                        size,
                        &streams[r],
                    )?;
                    l.launch(
                        &streams[r],
                        dtype,
                        n,
                        outputs[r] + (off * size) as u64,
                        used,
                    )?;
                }
            }
        }
        Ok(used)
    }

    /// Allocates registered (zero-copy) input buffers of `len` elements per
    /// rank, each on its rank's device; peers read them directly.
    pub fn alloc_registered<T: DeviceElement>(&self, len: usize) -> Result<RegisteredBuffers<T>> {
        let bufs = self
            .ranks
            .iter()
            .map(|r| DeviceAlloc::zeroed(r.kernels.context(), len * T::DTYPE.size()))
            .collect::<Result<Vec<_>>>()?;
        let refs: Vec<&RankBuffers> = self.ranks.iter().map(|r| &r.bufs).collect();
        let t = table(|r| bufs[r].ptr(), &refs);
        let tables = self
            .ranks
            .iter()
            .map(|r| DeviceAlloc::from_value(r.kernels.context(), &t))
            .collect::<Result<Vec<_>>>()?;
        Ok(RegisteredBuffers {
            bufs,
            tables,
            len,
            group: self.id,
            ctxs: self
                .ranks
                .iter()
                .map(|r| r.kernels.context().clone())
                .collect(),
            _t: PhantomData,
        })
    }

    /// Zero-copy allreduce of the first `count` elements of `reg` (written
    /// by each rank on its own stream beforehand) into `outputs`, with no
    /// staging copy. Works inside CUDA-graph capture of every rank's
    /// stream. Not chunked: a message above `Config::max_bytes` runs
    /// one-stage under `Auto` (same bits); an explicit `TwoStage` is refused.
    pub fn allreduce_registered<T: DeviceElement>(
        &self,
        streams: &[Arc<CudaStream>],
        reg: &RegisteredBuffers<T>,
        count: usize,
        outputs: &mut [CudaSlice<T>],
        algo: AlgoChoice,
    ) -> Result<Algorithm> {
        self.health.ensure_ok()?;
        reg.check_owner(self.id)?;
        self.check_streams(streams)?;
        check_count("outputs", outputs.len(), self.world)?;
        if count > reg.len {
            return Err(Error::BufferTooSmall {
                what: "registered buffer",
                rank: 0,
                len: reg.len,
                need: count,
            });
        }
        for (r, o) in outputs.iter().enumerate() {
            if o.len() < count {
                return Err(Error::BufferTooSmall {
                    what: "output",
                    rank: r,
                    len: o.len(),
                    need: count,
                });
            }
        }
        let used = registered_algorithm(
            &self.config,
            algo,
            count * T::DTYPE.size(),
            self.world,
            self.link,
        )?;
        for (r, o) in outputs.iter_mut().enumerate() {
            let (out, _g) = o.device_ptr_mut(&streams[r]);
            let l = self.rank_launch(r, reg.tables[r].ptr());
            // SAFETY: the registered buffers hold >= count elements and the
            // table names this group's scratch and signals (owner checked);
            // the output holds >= count elements.
            unsafe { l.launch(&streams[r], T::DTYPE, count, out, used)? };
        }
        Ok(used)
    }

    /// Waits for every rank's stream and reports recorded kernel errors.
    /// After an error the group is poisoned until [`PeerGroup::reset`].
    pub fn check(&self, streams: &[Arc<CudaStream>]) -> Result<()> {
        self.check_streams(streams)?;
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
