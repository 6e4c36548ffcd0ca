//! The CUDA IPC side of [`crate::ProcessGroup`]: the record every rank
//! publishes through the [`Exchange`] (its buffers' IPC handles, its
//! settings, its device), and opening the peers' buffers from them.
//!
//! Each rank allocates its staging, scratch and signal buffers with plain
//! `cuMemAlloc` (exportable), exports them with `cuIpcGetMemHandle`, and
//! all-gathers the records; then it opens every peer's handles. The
//! records are checked: same world, same settings, distinct processes.

use crate::abi::{RankTable, MAX_RANKS};
use crate::collective::RankBuffers;
use crate::driver::{self, IpcMapping, IPC_HANDLE_BYTES};
use crate::error::{Error, Result};
use crate::exchange::Exchange;
use crate::plan::{Config, Link};
use cudarc::driver::CudaContext;
use std::sync::Arc;

const MAGIC: u32 = 0x7032_7061; // "p2pa"
/// Bumped whenever what peers share changes shape: 6 for the 12 KiB
/// signal (push_islands' Back and Relay flags) and its landing zone.
const VERSION: u32 = 6;
pub(crate) const HANDLE: usize = IPC_HANDLE_BYTES;
/// Bytes of the PCI bus id field (`dddd:bb:dd.f`, NUL padded).
const BUS_ID: usize = 16;
/// magic, version, world, rank, pid, reserved (u32 each), max_bytes,
/// timeout_ns, threads/blocks, push_max_bytes, push_ll_max_bytes,
/// push_two_stage_max_bytes (u64 each), 3 IPC handles, the PCI bus id.
const U64S: usize = 6;
const HANDLES_AT: usize = 6 * 4 + U64S * 8;
const RECORD: usize = HANDLES_AT + 3 * HANDLE + BUS_ID;

struct Record {
    world: u32,
    rank: u32,
    pid: u32,
    bus: String,
    max_bytes: u64,
    timeout_ns: u64,
    launch: u64,
    push_max: u64,
    push_ll_max: u64,
    push2_max: u64,
    handles: [[u8; HANDLE]; 3],
}

impl Record {
    fn encode(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(RECORD);
        for x in [MAGIC, VERSION, self.world, self.rank, self.pid, 0] {
            v.extend_from_slice(&x.to_le_bytes());
        }
        for x in [
            self.max_bytes,
            self.timeout_ns,
            self.launch,
            self.push_max,
            self.push_ll_max,
            self.push2_max,
        ] {
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
            h.copy_from_slice(&b[HANDLES_AT + k * HANDLE..HANDLES_AT + (k + 1) * HANDLE]);
        }
        let bus = &b[HANDLES_AT + 3 * HANDLE..];
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
            push_max: u64_at(3),
            push_ll_max: u64_at(4),
            push2_max: u64_at(5),
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

/// What a rank learns at the rendezvous: every rank's staging and scratch
/// and signal as seen from this process, the slowest link, and the
/// mappings of the peers' buffers (kept open as long as the group lives).
pub(crate) struct Rendezvous {
    pub table: RankTable,
    pub signals: [u64; MAX_RANKS],
    pub link: Link,
    pub opened: Vec<IpcMapping>,
}

/// Publishes this rank's record, gathers every rank's, checks them, and
/// opens the peers' buffers.
pub(crate) fn rendezvous(
    ctx: &Arc<CudaContext>,
    exchange: &dyn Exchange,
    config: &Config,
    own: &RankBuffers,
) -> Result<Rendezvous> {
    let (rank, world) = (exchange.rank(), exchange.world());
    let bus = driver::pci_bus_id(ctx)?;
    let mine = Record {
        world: world as u32,
        rank: rank as u32,
        pid: std::process::id(),
        bus: bus.clone(),
        max_bytes: config.max_bytes as u64,
        timeout_ns: config.timeout_ns(),
        launch: (config.threads_per_block as u64) << 32 | config.max_blocks.unwrap_or(0) as u64,
        push_max: config.push_max_bytes as u64,
        push_ll_max: config.push_ll_max_bytes as u64,
        push2_max: config.push_two_stage_max_bytes as u64,
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
        let settings = |r: &Record| {
            (
                r.max_bytes,
                r.timeout_ns,
                r.launch,
                r.push_max,
                r.push_ll_max,
                r.push2_max,
            )
        };
        if settings(&rec) != settings(&mine) {
            return Err(mismatch(
                "Config (max_bytes, timeout, threads_per_block, max_blocks, push_max_bytes, \
                 push_ll_max_bytes, push_two_stage_max_bytes) differs"
                    .into(),
            ));
        }
        if p == rank {
            table.inputs[p] = own.staging.ptr();
            table.scratch[p] = own.scratch.ptr();
            signals[p] = own.signal.ptr();
            table.signals[p] = signals[p];
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
        table.signals[p] = signals[p];
        opened.extend([s, c, g]);
    }
    Ok(Rendezvous {
        table,
        signals,
        link,
        opened,
    })
}
