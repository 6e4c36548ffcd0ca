//! One process per rank: buffers shared through CUDA IPC handles.
//!
//! Each rank allocates its staging, scratch and signal buffers with plain
//! `cuMemAlloc` (exportable), exports them with `cuIpcGetMemHandle`, and
//! all-gathers the handles through an [`Exchange`]; then it opens every
//! peer's handles. A rank then launches the real-rank kernel entries on its
//! own stream, exactly like a [`crate::PeerGroup`] rank.

use crate::abi::{Algorithm, Dtype, RankTable, Signal, MAX_RANKS};
use crate::driver::{DeviceAlloc, Kernels};
use crate::error::{Context as _, Error, Result};
use crate::exchange::Exchange;
use crate::group::{
    check_aligned, check_world, chunks, read_error_records, stage, DeviceElement, Health,
    RankBuffers, RankLaunch,
};
use crate::plan::{AlgoChoice, Config, Link};
use cudarc::driver::{sys, CudaContext, CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
use std::sync::Arc;

const MAGIC: u32 = 0x7032_7061; // "p2pa"
const VERSION: u32 = 1;
const HANDLE: usize = 64;
/// magic, version, world, rank, pid, device bus id (u32 each), max_bytes,
/// timeout_ns, threads/blocks (u64 each), then 3 IPC handles.
const RECORD: usize = 6 * 4 + 3 * 8 + 3 * HANDLE;

/// A peer buffer opened from an IPC handle; closed on drop.
struct Opened {
    ctx: Arc<CudaContext>,
    ptr: u64,
}

impl Drop for Opened {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: `ptr` came from cuIpcOpenMemHandle and is closed once.
            let _ = unsafe { sys::cuIpcCloseMemHandle(self.ptr) };
        }
    }
}

/// This process's rank of a group formed over CUDA IPC.
///
/// ```no_run
/// use p2p_allreduce::{driver, AlgoChoice, Config, DirExchange, ProcessGroup};
/// use std::time::Duration;
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let (rank, world) = (0, 2); // e.g. from the launcher's environment
/// let ctx = driver::open_device(rank)?;
/// let stream = ctx.new_stream()?;
/// let ex = DirExchange::new("/tmp/my-job-rendezvous".as_ref(), rank, world, Duration::from_secs(60))?;
/// let group = ProcessGroup::new(&ctx, &ex, Config::default())?;
/// let input = stream.clone_htod(&vec![half::bf16::ONE; 4096])?;
/// let mut output = stream.alloc_zeros::<half::bf16>(4096)?;
/// group.allreduce(&stream, &input, &mut output, AlgoChoice::Auto)?;
/// group.check(&stream)?;
/// # Ok(()) }
/// ```
pub struct ProcessGroup {
    rank: usize,
    world: usize,
    config: Config,
    ctx: Arc<CudaContext>,
    kernels: Arc<Kernels>,
    own: RankBuffers,
    _opened: Vec<Opened>,
    table: DeviceAlloc,
    /// Host copy of `table`: the scratch pointers of every rank.
    host_table: RankTable,
    signals: [u64; MAX_RANKS],
    link: Link,
    health: Health,
    /// Pointer tables for allreduces captured in CUDA graphs, allocated up
    /// front (allocation is not allowed during capture) and zeroed: a kernel
    /// that finds a null input pointer reports `Error::Unregistered`.
    graph_slots: DeviceAlloc,
    graph: std::sync::Mutex<GraphState>,
}

/// Captured allreduces waiting for `register_captured`, and peer buffers
/// opened for earlier ones.
#[derive(Default)]
struct GraphState {
    used: usize,
    pending: Vec<Pending>,
    opened: Vec<(usize, [u8; HANDLE], Opened)>,
}

struct Pending {
    slot: usize,
    input: u64,
    handle: [u8; HANDLE],
    offset: u64,
}

/// How many allreduces one `ProcessGroup` can have captured in graphs.
pub const GRAPH_SLOTS: usize = 1024;

fn export_ptr(ptr: u64) -> Result<([u8; HANDLE], u64)> {
    let mut base: sys::CUdeviceptr = 0;
    let mut size: usize = 0;
    // SAFETY: plain query; `ptr` is checked by the driver.
    unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut size, ptr) }
        .result()
        .during("cuMemGetAddressRange (input of a captured allreduce)")?;
    let mut h = std::mem::MaybeUninit::<sys::CUipcMemHandle>::zeroed();
    // SAFETY: `base` is the start of a live allocation; the handle is plain bytes.
    unsafe { sys::cuIpcGetMemHandle(h.as_mut_ptr(), base) }
        .result()
        .during("cuIpcGetMemHandle (captured inputs must come from plain cuMemAlloc, not a stream-ordered pool)")?;
    // SAFETY: zero-initialised and then written by the driver.
    let h = unsafe { h.assume_init() };
    let mut out = [0u8; HANDLE];
    for (o, c) in out.iter_mut().zip(h.reserved.iter()) {
        *o = *c as u8;
    }
    Ok((out, ptr - base))
}

fn export(a: &DeviceAlloc) -> Result<[u8; HANDLE]> {
    let mut h = std::mem::MaybeUninit::<sys::CUipcMemHandle>::zeroed();
    // SAFETY: `a` is a live cuMemAlloc allocation; the handle is plain bytes.
    unsafe { sys::cuIpcGetMemHandle(h.as_mut_ptr(), a.ptr()) }
        .result()
        .during("cuIpcGetMemHandle")?;
    // SAFETY: written by the driver above (zeroed before in any case).
    let h = unsafe { h.assume_init() };
    let mut out = [0u8; HANDLE];
    for (o, c) in out.iter_mut().zip(h.reserved.iter()) {
        *o = *c as u8;
    }
    Ok(out)
}

fn open(ctx: &Arc<CudaContext>, bytes: &[u8]) -> Result<Opened> {
    let mut h = sys::CUipcMemHandle {
        reserved: [0; HANDLE],
    };
    for (d, b) in h.reserved.iter_mut().zip(bytes) {
        *d = *b as _;
    }
    let mut ptr: sys::CUdeviceptr = 0;
    ctx.bind_to_thread().during("cuCtxSetCurrent")?;
    // SAFETY: `h` is a handle exported by a peer process; the driver validates it.
    unsafe {
        sys::cuIpcOpenMemHandle_v2(
            &mut ptr,
            h,
            sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
        )
    }
    .result()
    .during("cuIpcOpenMemHandle")?;
    Ok(Opened {
        ctx: ctx.clone(),
        ptr,
    })
}

struct Record {
    world: u32,
    rank: u32,
    pid: u32,
    bus: u32,
    max_bytes: u64,
    timeout_ns: u64,
    launch: u64,
    handles: [[u8; HANDLE]; 3],
}

impl Record {
    fn encode(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(RECORD);
        for x in [MAGIC, VERSION, self.world, self.rank, self.pid, self.bus] {
            v.extend_from_slice(&x.to_le_bytes());
        }
        for x in [self.max_bytes, self.timeout_ns, self.launch] {
            v.extend_from_slice(&x.to_le_bytes());
        }
        for h in &self.handles {
            v.extend_from_slice(h);
        }
        v
    }
    fn decode(b: &[u8], from: usize) -> Result<Self> {
        let bad = |what: &str| Error::Rendezvous(format!("rank {from} sent {what}"));
        if b.len() != RECORD {
            return Err(bad(&format!(
                "{} bytes instead of {RECORD}: not a p2p-allreduce {VERSION} peer",
                b.len()
            )));
        }
        let u32_at =
            |i: usize| u32::from_le_bytes(b[i * 4..i * 4 + 4].try_into().unwrap_or_default());
        let u64_at =
            |i: usize| u64::from_le_bytes(b[24 + i * 8..32 + i * 8].try_into().unwrap_or_default());
        if u32_at(0) != MAGIC || u32_at(1) != VERSION {
            return Err(bad("a record of another version or program"));
        }
        let mut handles = [[0u8; HANDLE]; 3];
        for (k, h) in handles.iter_mut().enumerate() {
            h.copy_from_slice(&b[48 + k * HANDLE..48 + (k + 1) * HANDLE]);
        }
        Ok(Record {
            world: u32_at(2),
            rank: u32_at(3),
            pid: u32_at(4),
            bus: u32_at(5),
            max_bytes: u64_at(0),
            timeout_ns: u64_at(1),
            launch: u64_at(2),
            handles,
        })
    }
}

impl ProcessGroup {
    /// Forms rank `exchange.rank()` of a group of `exchange.world()` processes.
    /// Every rank must pass the same `config`; a mismatch is reported.
    pub fn new(ctx: &Arc<CudaContext>, exchange: &dyn Exchange, config: Config) -> Result<Self> {
        let (rank, world) = (exchange.rank(), exchange.world());
        check_world(world)?;
        config.validate().map_err(Error::Config)?;
        let kernels = Kernels::for_context(ctx)?;
        let own = RankBuffers::new(ctx, config.max_bytes)?;
        let bus = ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_PCI_BUS_ID)
            .during("cuDeviceGetAttribute(PCI bus id)")? as u32;
        let mine = Record {
            world: world as u32,
            rank: rank as u32,
            pid: std::process::id(),
            bus,
            max_bytes: config.max_bytes as u64,
            timeout_ns: config.timeout_ns(),
            launch: (config.threads_per_block as u64) << 32 | config.max_blocks as u64,
            handles: [
                export(&own.staging)?,
                export(&own.scratch)?,
                export(&own.signal)?,
            ],
        };
        let all = exchange.all_gather(&mine.encode())?;
        if all.len() != world {
            return Err(Error::Rendezvous(format!(
                "exchange returned {} records for {world} ranks",
                all.len()
            )));
        }
        let mut table = RankTable::default();
        let mut signals = [0u64; MAX_RANKS];
        let mut opened = Vec::new();
        let mut link = Link::SameDevice;
        for (p, bytes) in all.iter().enumerate() {
            let rec = Record::decode(bytes, p)?;
            let mismatch = |what: String| Error::GroupMismatch {
                rank,
                other: p,
                what,
            };
            if rec.world as usize != world || rec.rank as usize != p {
                return Err(mismatch(format!(
                    "it is rank {} of {}, here rank {p} of {world}",
                    rec.rank, rec.world
                )));
            }
            if (rec.max_bytes, rec.timeout_ns, rec.launch)
                != (mine.max_bytes, mine.timeout_ns, mine.launch)
            {
                return Err(mismatch(
                    "Config (max_bytes, timeout, threads_per_block, max_blocks) differs".into(),
                ));
            }
            if p == rank {
                table.inputs[p] = own.staging.ptr();
                table.scratch[p] = own.scratch.ptr();
                signals[p] = own.signal.ptr();
                continue;
            }
            if rec.pid == mine.pid {
                return Err(mismatch(
                    "both ranks are in one process: use VirtualGroup or PeerGroup there".into(),
                ));
            }
            if rec.bus != bus {
                link = Link::Pcie; // refined below when both devices are visible here
            }
            let [s, c, g] = &rec.handles;
            let (s, c, g) = (open(ctx, s)?, open(ctx, c)?, open(ctx, g)?);
            table.inputs[p] = s.ptr;
            table.scratch[p] = c.ptr;
            signals[p] = g.ptr;
            opened.extend([s, c, g]);
        }
        let t = DeviceAlloc::from_value(ctx, &table)?;
        Ok(ProcessGroup {
            rank,
            world,
            config,
            ctx: ctx.clone(),
            kernels,
            own,
            _opened: opened,
            table: t,
            host_table: table,
            signals,
            link,
            health: Health::new(),
            graph_slots: DeviceAlloc::zeroed(ctx, GRAPH_SLOTS * std::mem::size_of::<RankTable>())?,
            graph: std::sync::Mutex::new(GraphState::default()),
        })
    }

    pub fn rank(&self) -> usize {
        self.rank
    }
    pub fn world(&self) -> usize {
        self.world
    }

    /// Staged allreduce of this rank's `input` into `output`, on `stream`.
    /// Every rank must call it with the same dtype and length.
    pub fn allreduce<T: DeviceElement>(
        &self,
        stream: &Arc<CudaStream>,
        input: &CudaSlice<T>,
        output: &mut CudaSlice<T>,
        algo: AlgoChoice,
    ) -> Result<Algorithm> {
        self.health.ensure_ok()?;
        let count = input.len();
        if output.len() < count {
            return Err(Error::BufferTooSmall {
                what: "output",
                rank: self.rank,
                len: output.len(),
                need: count,
            });
        }
        let size = T::DTYPE.size();
        if count * size > self.config.max_bytes && !self.config.chunking {
            return Err(Error::MessageTooLarge {
                bytes: count * size,
                capacity: self.config.max_bytes,
            });
        }
        let (inp, _gi) = input.device_ptr(stream);
        let (out, _go) = output.device_ptr_mut(stream);
        check_aligned("output", self.rank, out)?;
        let l = RankLaunch {
            kernels: &self.kernels,
            config: &self.config,
            world: self.world,
            rank: self.rank,
            table: self.table.ptr(),
            signals: self.signals,
        };
        let mut used = Algorithm::OneStage;
        for (off, n) in chunks(count, T::DTYPE, self.config.max_bytes) {
            used = self
                .config
                .thresholds
                .choose(algo, n * size, self.world, self.link);
            // SAFETY: input holds `count` elements, staging max_bytes >= n *
            // size; the output holds `count` elements; the table and signals
            // point at this group's live (own or opened) buffers.
            unsafe {
                stage(self.own.staging.ptr(), inp, off, n, size, stream)?;
                l.launch(stream, T::DTYPE, n, out + (off * size) as u64, used)?;
            }
        }
        Ok(used)
    }

    /// [`ProcessGroup::allreduce`] after checking, through `exchange`, that
    /// every rank passes the same dtype, element count and algorithm choice.
    /// A mismatch is `Error::RankMismatch` on every rank, before any kernel
    /// runs (without the check, a different count would end in a peer
    /// timeout and a different dtype in wrong sums). Costs one host
    /// round trip per call: for debugging and for first calls.
    pub fn allreduce_checked<T: DeviceElement>(
        &self,
        exchange: &dyn Exchange,
        stream: &Arc<CudaStream>,
        input: &CudaSlice<T>,
        output: &mut CudaSlice<T>,
        algo: AlgoChoice,
    ) -> Result<Algorithm> {
        let code = |a: AlgoChoice| match a {
            AlgoChoice::Auto => 0u8,
            AlgoChoice::OneStage => 1,
            AlgoChoice::TwoStage => 2,
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
    /// Every rank must capture the same allreduces in the same order.
    ///
    /// # Safety
    /// `input` and `output` must stay valid for `count` elements of `dtype`
    /// for as long as the graph can be launched; `input` must come from plain
    /// `cuMemAlloc` (CUDA IPC cannot export stream-ordered pool memory) and
    /// must not be written while a replay runs.
    pub unsafe fn allreduce_in_graph(
        &self,
        stream: &CudaStream,
        dtype: Dtype,
        count: usize,
        input: u64,
        output: u64,
        algo: AlgoChoice,
    ) -> Result<Algorithm> {
        self.health.ensure_ok()?;
        let status = stream.capture_status().during("cuStreamGetCaptureInfo")?;
        if status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_ACTIVE {
            return Err(Error::Config(
                "allreduce_in_graph needs a stream that is capturing a CUDA graph; use allreduce outside capture".into(),
            ));
        }
        check_aligned("input", self.rank, input)?;
        check_aligned("output", self.rank, output)?;
        let bytes = count * dtype.size();
        let mut used = self
            .config
            .thresholds
            .choose(algo, bytes, self.world, self.link);
        if used == Algorithm::TwoStage && bytes > self.config.max_bytes {
            // One-stage needs no scratch and gives the same bits.
            used = Algorithm::OneStage;
        }
        let (handle, offset) = export_ptr(input)?;
        let mut g = self.graph.lock().unwrap_or_else(|p| p.into_inner());
        if g.used == GRAPH_SLOTS {
            return Err(Error::Config(format!(
                "more than {GRAPH_SLOTS} allreduces captured by one ProcessGroup"
            )));
        }
        let slot = g.used;
        g.used += 1;
        g.pending.push(Pending {
            slot,
            input,
            handle,
            offset,
        });
        let l = RankLaunch {
            kernels: &self.kernels,
            config: &self.config,
            world: self.world,
            rank: self.rank,
            table: self.graph_slots.ptr() + (slot * std::mem::size_of::<RankTable>()) as u64,
            signals: self.signals,
        };
        // SAFETY: the slot lies inside `graph_slots`; input and output are
        // valid per the caller's contract; signals and scratch are live.
        unsafe { l.launch(stream, dtype, count, output, used)? };
        Ok(used)
    }

    /// After capture: exchanges the IPC handles of every input captured by
    /// [`ProcessGroup::allreduce_in_graph`] since the last call, opens the
    /// peers' buffers (once per buffer) and fills the pointer tables the
    /// captured kernels read. Every rank calls it after the same captures.
    /// Returns how many captured allreduces were registered.
    pub fn register_captured(&self, exchange: &dyn Exchange) -> Result<usize> {
        let mut g = self.graph.lock().unwrap_or_else(|p| p.into_inner());
        let mut mine = Vec::with_capacity(g.pending.len() * (HANDLE + 8));
        for p in &g.pending {
            mine.extend_from_slice(&p.handle);
            mine.extend_from_slice(&p.offset.to_le_bytes());
        }
        let all = exchange.all_gather(&mine)?;
        for (r, b) in all.iter().enumerate() {
            if b.len() != mine.len() {
                return Err(Error::GroupMismatch {
                    rank: self.rank,
                    other: r,
                    what: format!(
                        "it captured {} allreduces, this rank {}",
                        b.len() / (HANDLE + 8),
                        g.pending.len()
                    ),
                });
            }
        }
        let pending = std::mem::take(&mut g.pending);
        let n = pending.len();
        for (i, p) in pending.iter().enumerate() {
            let mut t = RankTable {
                inputs: [0; MAX_RANKS],
                scratch: self.host_table.scratch,
            };
            for (r, b) in all.iter().enumerate() {
                if r == self.rank {
                    t.inputs[r] = p.input;
                    continue;
                }
                let rec = &b[i * (HANDLE + 8)..(i + 1) * (HANDLE + 8)];
                let mut handle = [0u8; HANDLE];
                handle.copy_from_slice(&rec[..HANDLE]);
                let offset = u64::from_le_bytes(rec[HANDLE..].try_into().unwrap_or_default());
                let base = match g.opened.iter().find(|(pr, h, _)| *pr == r && *h == handle) {
                    Some((_, _, o)) => o.ptr,
                    None => {
                        let o = open(&self.ctx, &handle)?;
                        let ptr = o.ptr;
                        g.opened.push((r, handle, o));
                        ptr
                    }
                };
                t.inputs[r] = base + offset;
            }
            let off = p.slot * std::mem::size_of::<RankTable>();
            self.ctx.bind_to_thread().during("cuCtxSetCurrent")?;
            // SAFETY: the slot lies inside `graph_slots`; RankTable is plain data.
            unsafe {
                cudarc::driver::result::memcpy_htod_sync(
                    self.graph_slots.ptr() + off as u64,
                    std::slice::from_ref(&t),
                )
            }
            .during("cuMemcpyHtoD (graph pointer table)")?;
        }
        Ok(n)
    }

    /// Waits for `stream`, then reports an error this rank's kernels recorded.
    pub fn check(&self, stream: &CudaStream) -> Result<()> {
        stream.synchronize().during("cuStreamSynchronize")?;
        read_error_records(&[&self.own.signal]).inspect_err(|e| self.health.poison(e))
    }

    /// Zeroes this rank's signal after waiting for the device. Every rank
    /// must reset (and agree on it out of band) before the next collective.
    pub fn reset(&self) -> Result<()> {
        self.ctx.synchronize().during("cuCtxSynchronize")?;
        self.own
            .signal
            .write(&[0u8; std::mem::size_of::<Signal>()])?;
        self.health.clear();
        Ok(())
    }
}
