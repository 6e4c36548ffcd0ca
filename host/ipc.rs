//! The CUDA IPC side of [`crate::ProcessGroup`]: who the ranks are, the
//! record every rank publishes through the [`Exchange`] (its buffers' IPC
//! handles, its settings, its device), and opening the peers' buffers from
//! them.
//!
//! Two rounds. First ([`introduce`], before any CUDA call) every rank
//! publishes its identity: the build of p2p-allreduce it runs
//! ([`crate::ptx::build_id`]), its rank and world, its process and its
//! host (hostname and the kernel's boot id). A group whose ranks run
//! different builds, or on different hosts (CUDA IPC handles cannot be
//! opened on another host), is refused here with a typed error
//! (`GroupMismatch`, `CrossHost`), before any buffer is allocated or any
//! handle opened. Then each rank allocates its staging, scratch and signal
//! buffers with plain `cuMemAlloc` (exportable), exports them with
//! `cuIpcGetMemHandle`, and all-gathers the records ([`Exchange::all_gather`]);
//! every record is checked (same world, same settings) before any peer's
//! handles are opened.

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

/// Version of the identity record ([`Identity`]); bumped when its keys change.
const HELLO_VERSION: u32 = 1;
const HELLO_MAGIC: &str = "p2p-allreduce identity";

/// Who a rank is: the first record of a `ProcessGroup`'s rendezvous
/// ([`introduce`]). A text record, one `key=value` line each, so that a
/// test (or a curious user) can read and forge it:
///
/// ```text
/// p2p-allreduce identity 1
/// build=8c1f0a3e5b2d4f61
/// world=2
/// rank=0
/// pid=4242
/// host=gpu-node-7
/// boot=3f0c9a5e-...
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Identity {
    /// [`crate::ptx::build_id`] of the process.
    pub build: u64,
    pub world: usize,
    pub rank: usize,
    pub pid: u32,
    /// The hostname (`/proc/sys/kernel/hostname`; "unknown" where unreadable).
    pub host: String,
    /// The running kernel's boot id (`/proc/sys/kernel/random/boot_id`),
    /// the same in every container of one host and different on every
    /// other host; empty where unreadable.
    pub boot: String,
}

/// Reads a one-line `/proc` file, trimmed; `None` where it cannot be read.
fn proc_line(path: &str) -> Option<String> {
    let s = std::fs::read_to_string(path).ok()?;
    let s = s.trim();
    (!s.is_empty()).then(|| s.to_string())
}

/// Keeps a record value on its line: no newlines, no `=`.
fn one_line(s: &str) -> String {
    s.chars()
        .map(|c| if c.is_control() || c == '=' { '_' } else { c })
        .collect()
}

impl Identity {
    /// This process as rank `rank` of `world`.
    pub fn of_this_process(rank: usize, world: usize) -> Identity {
        Identity {
            build: crate::ptx::build_id(),
            world,
            rank,
            pid: std::process::id(),
            host: proc_line("/proc/sys/kernel/hostname")
                .or_else(|| std::env::var("HOSTNAME").ok())
                .map_or_else(|| "unknown".into(), |h| one_line(&h)),
            boot: proc_line("/proc/sys/kernel/random/boot_id")
                .map_or_else(String::new, |b| one_line(&b)),
        }
    }

    /// The record's text.
    pub fn encode(&self) -> Vec<u8> {
        format!(
            "{HELLO_MAGIC} {HELLO_VERSION}\nbuild={:016x}\nworld={}\nrank={}\npid={}\nhost={}\nboot={}\n",
            self.build,
            self.world,
            self.rank,
            self.pid,
            one_line(&self.host),
            one_line(&self.boot)
        )
        .into_bytes()
    }

    /// Parses rank `from`'s record: `Rendezvous` for what is not one,
    /// `GroupMismatch` (as rank `me`) for one of another version.
    pub fn decode(b: &[u8], from: usize, me: usize) -> Result<Identity> {
        let bad = |what: String| Error::Rendezvous(format!("rank {from} sent {what}"));
        // A peer of an older p2p-allreduce sends its IPC record first.
        if b.len() >= 8 && b[..4] == MAGIC.to_le_bytes() {
            let v = u32::from_le_bytes(b[4..8].try_into().unwrap_or_default());
            return Err(Error::GroupMismatch {
                rank: me,
                other: from,
                what: format!(
                    "it runs an older p2p-allreduce (IPC record version {v}, no identity record): run the \
                     same build on every rank"
                ),
            });
        }
        let text = std::str::from_utf8(b)
            .map_err(|_| bad(format!("{} bytes that are not an identity record", b.len())))?;
        let mut lines = text.lines();
        let head = lines.next().unwrap_or_default();
        let version = head
            .strip_prefix(HELLO_MAGIC)
            .and_then(|v| v.trim().parse::<u32>().ok())
            .ok_or_else(|| {
                bad(format!(
                    "a record that is not a p2p-allreduce identity ({head:?})"
                ))
            })?;
        if version != HELLO_VERSION {
            return Err(Error::GroupMismatch {
                rank: me,
                other: from,
                what: format!(
                    "its identity record is version {version}, this rank's {HELLO_VERSION}: run the same \
                     build on every rank"
                ),
            });
        }
        let mut get = |key: &str| -> Result<String> {
            let line = lines
                .next()
                .ok_or_else(|| bad(format!("an identity record without {key}")))?;
            line.strip_prefix(key)
                .and_then(|l| l.strip_prefix('='))
                .map(str::to_string)
                .ok_or_else(|| {
                    bad(format!(
                        "an identity record with {line:?} where {key}= belongs"
                    ))
                })
        };
        let num = |key: &str, v: String| -> Result<u64> {
            v.parse::<u64>()
                .map_err(|_| bad(format!("an identity record with {key}={v:?}")))
        };
        let build = get("build")?;
        let build = u64::from_str_radix(&build, 16)
            .map_err(|_| bad(format!("an identity record with build={build:?}")))?;
        let world = num("world", get("world")?)?;
        let rank = num("rank", get("rank")?)?;
        let pid = num("pid", get("pid")?)?;
        let (Ok(world), Ok(rank), Ok(pid)) = (
            usize::try_from(world),
            usize::try_from(rank),
            u32::try_from(pid),
        ) else {
            return Err(bad(format!(
                "an identity record with world={world}, rank={rank}, pid={pid}, past what they can be"
            )));
        };
        let host = get("host")?;
        let boot = get("boot")?;
        Ok(Identity {
            build,
            world,
            rank,
            pid,
            host,
            boot,
        })
    }

    /// Whether `self` and `other` run on one host: the same boot id where
    /// both know theirs (containers of one host share it; hostnames may
    /// differ there), else the same hostname.
    pub fn same_host(&self, other: &Identity) -> bool {
        if !self.boot.is_empty() && !other.boot.is_empty() {
            self.boot == other.boot
        } else {
            self.host == other.host
        }
    }

    /// "host (boot id 3f0c9a5e)", for messages.
    fn host_label(&self) -> String {
        match self.boot.get(..8) {
            Some(b) => format!("{} (boot id {b})", self.host),
            None => self.host.clone(),
        }
    }
}

/// The first round of a `ProcessGroup`'s rendezvous, before any CUDA call:
/// publishes this process's [`Identity`] and checks every rank's. See
/// [`introduce_as`].
pub fn introduce(exchange: &dyn Exchange) -> Result<Vec<Identity>> {
    introduce_as(
        exchange,
        &Identity::of_this_process(exchange.rank(), exchange.world()),
    )
}

/// [`introduce`] with `me` as this rank's identity (tests pass forged
/// ones). Every rank's record is read and checked before any error is
/// returned: a record that is not one (`Rendezvous`), another version or
/// build, world or rank (`GroupMismatch`), another host (`CrossHost`), two
/// ranks in one process (`GroupMismatch`: use VirtualGroup or PeerGroup).
pub fn introduce_as(exchange: &dyn Exchange, me: &Identity) -> Result<Vec<Identity>> {
    let (rank, world) = (exchange.rank(), exchange.world());
    if rank >= world {
        return Err(Error::Config(format!(
            "the exchange says rank {rank} of a world of {world}"
        )));
    }
    let all = exchange.all_gather(&me.encode())?;
    if all.len() != world {
        return Err(Error::Rendezvous(format!(
            "exchange returned {} records for {world} ranks",
            all.len()
        )));
    }
    let ids = all
        .iter()
        .enumerate()
        .map(|(p, b)| Identity::decode(b, p, rank))
        .collect::<Result<Vec<_>>>()?;
    for (p, id) in ids.iter().enumerate() {
        let mismatch = |what: String| Error::GroupMismatch {
            rank,
            other: p,
            what,
        };
        if id.world != world || id.rank != p {
            return Err(mismatch(format!(
                "it is rank {} of {}, here rank {p} of {world}",
                id.rank, id.world
            )));
        }
        if id.build != me.build {
            return Err(mismatch(format!(
                "it runs another build of p2p-allreduce (build id {:016x}, this rank's {:016x}): run the \
                 same binary or wheel on every rank",
                id.build, me.build
            )));
        }
    }
    for (p, id) in ids.iter().enumerate() {
        if !me.same_host(id) {
            return Err(Error::CrossHost {
                rank,
                host: me.host_label(),
                peer: p,
                peer_host: id.host_label(),
            });
        }
    }
    for (p, id) in ids.iter().enumerate() {
        if p != rank && id.pid == me.pid {
            return Err(Error::GroupMismatch {
                rank,
                other: p,
                what: "both ranks are in one process: use VirtualGroup or PeerGroup there".into(),
            });
        }
    }
    Ok(ids)
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

/// Checks that `bytes` bytes at `offset` of rank `peer`'s `what`, whose
/// allocation is mapped here with `mapped` bytes from the mapped address
/// on, lie inside that mapping (as rank `rank`): `PeerBufferTooSmall`,
/// naming both ranks and the sizes, where they do not (also where
/// `offset + bytes` overflows).
pub(crate) fn check_mapped(
    rank: usize,
    peer: usize,
    what: &'static str,
    offset: u64,
    bytes: u64,
    mapped: u64,
) -> Result<()> {
    match offset.checked_add(bytes) {
        Some(end) if end <= mapped => Ok(()),
        _ => Err(Error::PeerBufferTooSmall {
            rank,
            peer,
            what,
            offset,
            bytes,
            mapped,
        }),
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

/// Every rank's record, gathered and checked (same world, same settings)
/// by [`publish`]; nothing opened yet.
pub(crate) struct Records {
    rank: usize,
    bus: String,
    recs: Vec<Record>,
}

/// Publishes this rank's record (its buffers' IPC handles, settings and
/// device), gathers every rank's and checks them: the same on every rank,
/// so every rank returns the same error for records that disagree. Opens
/// nothing: [`open_peers`] does, after this.
pub(crate) fn publish(
    ctx: &Arc<CudaContext>,
    exchange: &dyn Exchange,
    config: &Config,
    own: &RankBuffers,
) -> Result<Records> {
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
    let recs = check_records(&all, rank, world, &mine)?;
    Ok(Records { rank, bus, recs })
}

/// Decodes every rank's record and checks it against this rank's `mine`
/// (same world, each rank in its place, same settings, another process):
/// every record is checked before any peer's handle is opened.
fn check_records(all: &[Vec<u8>], rank: usize, world: usize, mine: &Record) -> Result<Vec<Record>> {
    if all.len() != world {
        return Err(Error::Rendezvous(format!(
            "exchange returned {} records for {world} ranks",
            all.len()
        )));
    }
    let recs = all
        .iter()
        .enumerate()
        .map(|(p, bytes)| Record::decode(bytes, p))
        .collect::<Result<Vec<_>>>()?;
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
    for (p, rec) in recs.iter().enumerate() {
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
        if settings(rec) != settings(mine) {
            return Err(mismatch(
                "Config (max_bytes, timeout, threads_per_block, max_blocks, push_max_bytes, \
                 push_ll_max_bytes, push_two_stage_max_bytes) differs"
                    .into(),
            ));
        }
        if p != rank && rec.pid == mine.pid {
            return Err(mismatch(
                "both ranks are in one process: use VirtualGroup or PeerGroup there".into(),
            ));
        }
    }
    Ok(recs)
}

/// Opens the peers' buffers named by `records` and checks that each
/// mapping is as large as `config` needs (staging and scratch of
/// `Config::max_bytes`, the signal and its landing zones): a peer whose
/// allocation is smaller is `PeerBufferTooSmall` here, before any kernel
/// can run. Local to this rank (a peer's mapping may fail here and not
/// there): the caller follows it with a round in which every rank says how
/// it went.
pub(crate) fn open_peers(
    ctx: &Arc<CudaContext>,
    config: &Config,
    own: &RankBuffers,
    records: &Records,
) -> Result<Rendezvous> {
    let Records { rank, bus, recs } = records;
    let rank = *rank;
    let need = RankBuffers::sizes(config, recs.len());
    let mut table = RankTable::default();
    let mut signals = [0u64; MAX_RANKS];
    let mut opened = Vec::new();
    let mut link = Link::SameDevice;
    for (p, rec) in recs.iter().enumerate() {
        if p == rank {
            table.inputs[p] = own.staging.ptr();
            table.scratch[p] = own.scratch.ptr();
            signals[p] = own.signal.ptr();
            table.signals[p] = signals[p];
            continue;
        }
        link = crate::topology::slowest(link, peer_link(ctx, bus, &rec.bus)?);
        let mut ptrs = [0u64; 3];
        for (k, handle) in rec.handles.iter().enumerate() {
            let m = IpcMapping::open(ctx, handle)?;
            check_mapped(rank, p, BUFFER_NAMES[k], 0, need[k] as u64, m.bytes())?;
            ptrs[k] = m.ptr();
            opened.push(m);
        }
        let [s, c, g] = ptrs;
        table.inputs[p] = s;
        table.scratch[p] = c;
        signals[p] = g;
        table.signals[p] = signals[p];
    }
    Ok(Rendezvous {
        table,
        signals,
        link,
        opened,
    })
}

/// The group buffers a record's handles name, in order.
const BUFFER_NAMES: [&str; 3] = [
    "staging buffer",
    "scratch buffer",
    "signal and landing zones",
];

/// What [`crate::ProcessGroup::new_forged`] makes this rank publish, as a broken
/// or hostile peer would: for tests of the peers' checks (issue 48). The
/// default forges nothing.
#[doc(hidden)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Forgery {
    /// This rank's staging allocation holds this many bytes, not
    /// `Config::max_bytes` (its record still says `max_bytes`).
    pub staging_bytes: Option<usize>,
    /// Added to the offset every zero-copy record of this rank claims
    /// (registered and captured buffers).
    pub record_offset: u64,
    /// Added to the length every registered-buffer record of this rank
    /// claims.
    pub record_bytes: u64,
}

#[cfg(test)]
mod tests;
