//! One process per rank: buffers shared through CUDA IPC handles.
//!
//! Each rank allocates its staging, scratch and signal buffers with plain
//! `cuMemAlloc` (exportable), exports them with `cuIpcGetMemHandle`, and
//! all-gathers the handles through an [`Exchange`]; then it opens every
//! peer's handles. A rank then launches the real-rank kernel entries on its
//! own stream, exactly like a [`crate::PeerGroup`] rank.

use crate::abi::{Algorithm, Dtype, RankTable, Signal, MAX_RANKS};
use crate::driver::{self, DeviceAlloc, IpcMapping, Kernels, IPC_HANDLE_BYTES};
use crate::error::{Context as _, Error, Result};
use crate::exchange::Exchange;
use crate::group::{
    check_aligned, check_world, chunks, read_error_records, registered_algorithm, stage,
    DeviceElement, Health, RankBuffers, RankLaunch,
};
use crate::plan::{AlgoChoice, Config, Link};
use cudarc::driver::{sys, CudaContext, CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
use std::sync::Arc;

const MAGIC: u32 = 0x7032_7061; // "p2pa"
const VERSION: u32 = 2;
const HANDLE: usize = IPC_HANDLE_BYTES;
/// Bytes of the PCI bus id field (`dddd:bb:dd.f`, NUL padded).
const BUS_ID: usize = 16;
/// magic, version, world, rank, pid, reserved (u32 each), max_bytes,
/// timeout_ns, threads/blocks (u64 each), 3 IPC handles, the PCI bus id.
const RECORD: usize = 6 * 4 + 3 * 8 + 3 * HANDLE + BUS_ID;

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
    _opened: Vec<IpcMapping>,
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
    opened: Vec<(usize, [u8; HANDLE], IpcMapping)>,
}

struct Pending {
    slot: usize,
    input: u64,
    handle: [u8; HANDLE],
    offset: u64,
}

/// How many allreduces one `ProcessGroup` can have captured in graphs.
pub const GRAPH_SLOTS: usize = 4096;

/// The IPC handle of the allocation holding `ptr`, and `ptr`'s offset in it.
fn export_ptr(ctx: &Arc<CudaContext>, ptr: u64) -> Result<([u8; HANDLE], u64)> {
    let (base, _) = driver::address_range(ctx, ptr)?;
    Ok((driver::ipc_export(ctx, base)?, ptr - base))
}

struct Record {
    world: u32,
    rank: u32,
    pid: u32,
    bus: String,
    max_bytes: u64,
    timeout_ns: u64,
    launch: u64,
    handles: [[u8; HANDLE]; 3],
}

impl Record {
    fn encode(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(RECORD);
        for x in [MAGIC, VERSION, self.world, self.rank, self.pid, 0] {
            v.extend_from_slice(&x.to_le_bytes());
        }
        for x in [self.max_bytes, self.timeout_ns, self.launch] {
            v.extend_from_slice(&x.to_le_bytes());
        }
        for h in &self.handles {
            v.extend_from_slice(h);
        }
        let mut bus = [0u8; BUS_ID];
        for (d, b) in bus.iter_mut().zip(self.bus.bytes()) {
            *d = b;
        }
        v.extend_from_slice(&bus);
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
        let bus = &b[48 + 3 * HANDLE..];
        let bus =
            String::from_utf8_lossy(&bus[..bus.iter().position(|&c| c == 0).unwrap_or(BUS_ID)])
                .into_owned();
        Ok(Record {
            world: u32_at(2),
            rank: u32_at(3),
            pid: u32_at(4),
            bus,
            max_bytes: u64_at(0),
            timeout_ns: u64_at(1),
            launch: u64_at(2),
            handles,
        })
    }
}

/// The link from this rank's device (PCI bus id `mine`) to peer `p`'s
/// (`theirs`). Both devices are usually visible to this process; when the
/// peer's is hidden (e.g. by `CUDA_VISIBLE_DEVICES`), the driver cannot be
/// asked and the slower PCIe is assumed (thresholds only move speed).
fn peer_link(ctx: &Arc<CudaContext>, mine: &str, theirs: &str) -> Result<Link> {
    if mine.eq_ignore_ascii_case(theirs) {
        return Ok(Link::SameDevice);
    }
    match driver::device_by_pci_bus_id(theirs) {
        Some(dev) => crate::topology::link_between_devices(ctx.cu_device(), dev)?.ok_or(
            Error::NoPeerAccess {
                a: ctx.ordinal(),
                b: dev as usize,
            },
        ),
        None => Ok(Link::Pcie),
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
        kernels.prepare(world, false, config.threads_per_block)?;
        let own = RankBuffers::new(ctx, config.max_bytes)?;
        let bus = driver::pci_bus_id(ctx)?;
        let mine = Record {
            world: world as u32,
            rank: rank as u32,
            pid: std::process::id(),
            bus: bus.clone(),
            max_bytes: config.max_bytes as u64,
            timeout_ns: config.timeout_ns(),
            launch: (config.threads_per_block as u64) << 32 | config.max_blocks.unwrap_or(0) as u64,
            handles: [
                driver::ipc_export(ctx, own.staging.ptr())?,
                driver::ipc_export(ctx, own.scratch.ptr())?,
                driver::ipc_export(ctx, own.signal.ptr())?,
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
            link = crate::topology::slowest(link, peer_link(ctx, &bus, &rec.bus)?);
            let [s, c, g] = &rec.handles;
            let (s, c, g) = (
                IpcMapping::open(ctx, s)?,
                IpcMapping::open(ctx, c)?,
                IpcMapping::open(ctx, g)?,
            );
            table.inputs[p] = s.ptr();
            table.scratch[p] = c.ptr();
            signals[p] = g.ptr();
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
    /// Every rank must call it with the same dtype and length. Returns the
    /// algorithm used (of the last chunk, for messages above
    /// `Config::max_bytes`). Kernel errors (a peer timeout) are reported by
    /// [`ProcessGroup::check`]; until then later calls return `Ok`.
    pub fn allreduce<T: DeviceElement>(
        &self,
        stream: &Arc<CudaStream>,
        input: &CudaSlice<T>,
        output: &mut CudaSlice<T>,
        algo: AlgoChoice,
    ) -> Result<Algorithm> {
        let count = input.len();
        if output.len() < count {
            return Err(Error::BufferTooSmall {
                what: "output",
                rank: self.rank,
                len: output.len(),
                need: count,
            });
        }
        let (inp, _gi) = input.device_ptr(stream);
        let (out, _go) = output.device_ptr_mut(stream);
        // SAFETY: both slices are live, hold >= count elements and are
        // guarded until the work is enqueued on `stream`.
        unsafe { self.allreduce_raw(stream, T::DTYPE, count, inp, out, algo) }
    }

    /// [`ProcessGroup::allreduce`] on raw device pointers of this rank's
    /// device. The input is staged, so `output == input` (in place) is allowed.
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
        self.health.ensure_ok()?;
        if stream.context().cu_ctx() != self.ctx.cu_ctx() {
            return Err(Error::StreamDevice {
                rank: self.rank,
                stream_device: stream.context().ordinal(),
                rank_device: self.ctx.ordinal(),
            });
        }
        let size = dtype.size();
        if count * size > self.config.max_bytes && !self.config.chunking {
            return Err(Error::MessageTooLarge {
                bytes: count * size,
                capacity: self.config.max_bytes,
            });
        }
        check_aligned("output", self.rank, output)?;
        let l = RankLaunch {
            kernels: &self.kernels,
            config: &self.config,
            link: self.link,
            world: self.world,
            rank: self.rank,
            table: self.table.ptr(),
            signals: self.signals,
        };
        let mut used = Algorithm::OneStage;
        for (off, n) in chunks(count, dtype, self.config.max_bytes) {
            used = self
                .config
                .thresholds
                .choose(algo, n * size, self.world, self.link);
            // SAFETY: input holds `count` elements (caller), staging holds
            // max_bytes >= n * size; the output holds `count` elements; the
            // table and signals point at this group's live (own or opened)
            // buffers.
            unsafe {
                stage(self.own.staging.ptr(), input, off, n, size, stream)?;
                l.launch(stream, dtype, n, output + (off * size) as u64, used)?;
            }
        }
        Ok(used)
    }

    /// The link to the slowest peer (as `PeerGroup::link`).
    pub fn link(&self) -> Link {
        self.link
    }
    pub fn config(&self) -> &Config {
        &self.config
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
        let used = registered_algorithm(
            &self.config,
            algo,
            count * dtype.size(),
            self.world,
            self.link,
        )?;
        let (handle, offset) = export_ptr(&self.ctx, input)?;
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
            link: self.link,
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
                    Some((_, _, o)) => o.ptr(),
                    None => {
                        let o = IpcMapping::open(&self.ctx, &handle)?;
                        let ptr = o.ptr();
                        g.opened.push((r, handle, o));
                        ptr
                    }
                };
                t.inputs[r] = base + offset;
            }
            let off = p.slot * std::mem::size_of::<RankTable>();
            // SAFETY: the slot lies inside `graph_slots` (a live allocation
            // of this context); RankTable is plain data.
            unsafe {
                driver::write_at(
                    &self.ctx,
                    self.graph_slots.ptr() + off as u64,
                    std::slice::from_ref(&t),
                )?
            };
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
