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
//! `cuIpcGetMemHandle`, and all-gathers the records ([`rendezvous`]);
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
        let world = num("world", get("world")?)? as usize;
        let rank = num("rank", get("rank")?)? as usize;
        let pid = num("pid", get("pid")?)? as u32;
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
    // Every record is checked before any peer's handle is opened.
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
        if settings(rec) != settings(&mine) {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::exchange::InProcessExchange;
    use std::time::Duration;

    fn id(rank: usize, world: usize, host: &str, boot: &str) -> Identity {
        Identity {
            build: crate::ptx::build_id(),
            world,
            rank,
            pid: 1000 + rank as u32,
            host: host.into(),
            boot: boot.into(),
        }
    }

    /// Runs `introduce_as` on every rank (threads of this process, one
    /// forged identity each) and returns each rank's result.
    fn meet(ids: Vec<Identity>) -> Vec<Result<Vec<Identity>>> {
        let eps = InProcessExchange::ranks(ids.len(), Duration::from_secs(5));
        let hs: Vec<_> = eps
            .into_iter()
            .zip(ids)
            .map(|(ep, me)| std::thread::spawn(move || introduce_as(&ep, &me)))
            .collect();
        hs.into_iter().map(|h| h.join().expect("thread")).collect()
    }

    #[test]
    fn identity_records_round_trip_and_are_text() {
        let me = Identity::of_this_process(1, 3);
        assert_eq!(me.pid, std::process::id());
        assert_eq!(me.build, crate::ptx::build_id());
        let text = String::from_utf8(me.encode()).expect("text");
        assert!(
            text.starts_with("p2p-allreduce identity 1\nbuild="),
            "{text}"
        );
        assert!(
            text.contains("\nrank=1\n") && text.contains("\nworld=3\n"),
            "{text}"
        );
        assert_eq!(Identity::decode(&me.encode(), 1, 0).expect("decode"), me);
        // A hostname with a newline or '=' cannot break the record.
        let odd = Identity {
            host: "a\nrank=7=x".into(),
            ..id(0, 2, "", "")
        };
        let back = Identity::decode(&odd.encode(), 0, 1).expect("decode");
        assert_eq!((back.rank, back.host.as_str()), (0, "a_rank_7_x"));
    }

    /// Issue 31: a group whose ranks are on different hosts is refused at
    /// the first round, on every rank, naming both hosts (CUDA IPC handles
    /// cannot be opened on another host).
    #[test]
    fn ranks_on_two_hosts_are_refused_on_every_rank() {
        let got = meet(vec![
            id(0, 3, "node-a", "11111111-aaaa"),
            id(1, 3, "node-a", "11111111-aaaa"),
            id(2, 3, "node-b", "22222222-bbbb"),
        ]);
        for (r, g) in got.iter().enumerate() {
            match g {
                Err(Error::CrossHost {
                    rank,
                    host,
                    peer,
                    peer_host,
                }) => {
                    assert_eq!(*rank, r);
                    let msg = g.as_ref().err().map(|e| e.to_string()).unwrap_or_default();
                    assert!(msg.contains("NCCL"), "{msg}");
                    if r < 2 {
                        assert_eq!(
                            (*peer, peer_host.as_str()),
                            (2, "node-b (boot id 22222222)")
                        );
                        assert_eq!(host, "node-a (boot id 11111111)");
                    } else {
                        assert_eq!(*peer, 0);
                        assert_eq!(host, "node-b (boot id 22222222)");
                    }
                }
                other => panic!("rank {r}: expected CrossHost, got {other:?}"),
            }
        }
        // Without boot ids, hostnames decide.
        let got = meet(vec![id(0, 2, "node-a", ""), id(1, 2, "node-b", "")]);
        assert!(got
            .iter()
            .all(|g| matches!(g, Err(Error::CrossHost { .. }))));
    }

    #[test]
    fn one_host_meets_even_with_two_hostnames() {
        // Containers of one host: different hostnames, one boot id.
        let got = meet(vec![
            id(0, 2, "container-1", "33333333-cccc"),
            id(1, 2, "container-2", "33333333-cccc"),
        ]);
        for g in got {
            let ids = g.expect("one host");
            assert_eq!(ids.iter().map(|i| i.rank).collect::<Vec<_>>(), vec![0, 1]);
        }
    }

    /// A record from another build (or another identity version) is a
    /// typed mismatch on every rank, before any CUDA call.
    #[test]
    fn another_build_is_refused() {
        let mut other = id(1, 2, "h", "b");
        other.build ^= 1;
        for g in meet(vec![id(0, 2, "h", "b"), other]) {
            match g {
                Err(Error::GroupMismatch { what, .. }) => {
                    assert!(what.contains("another build"), "{what}")
                }
                other => panic!("expected GroupMismatch, got {other:?}"),
            }
        }
    }

    #[test]
    fn foreign_and_old_records_are_typed() {
        let junk = Identity::decode(b"\x00\x01garbage", 1, 0);
        assert!(matches!(junk, Err(Error::Rendezvous(_))), "{junk:?}");
        let v2 = b"p2p-allreduce identity 2\nbuild=0\n";
        assert!(matches!(
            Identity::decode(v2, 1, 0),
            Err(Error::GroupMismatch { other: 1, .. })
        ));
        // An older p2p-allreduce sends its IPC record (magic, version) first.
        let mut old = MAGIC.to_le_bytes().to_vec();
        old.extend_from_slice(&6u32.to_le_bytes());
        old.resize(RECORD, 0);
        match Identity::decode(&old, 1, 0) {
            Err(Error::GroupMismatch { what, .. }) => assert!(what.contains("older"), "{what}"),
            other => panic!("{other:?}"),
        }
        let cut = b"p2p-allreduce identity 1\nbuild=00000000000000ff\nworld=2\n";
        assert!(matches!(
            Identity::decode(cut, 1, 0),
            Err(Error::Rendezvous(_))
        ));
    }

    /// Fault matrix (issue 31): the rendezvous directory holds rank 1's
    /// identity record from another build, written by a live process: the
    /// survivor gets `GroupMismatch` at once (well within the timeout), no
    /// CUDA touched; then a new group in the same directory meets.
    #[test]
    fn a_record_of_another_build_in_the_directory_is_refused_at_once() {
        use crate::exchange::{forge_dir_record, DirExchange};
        let dir = std::env::temp_dir().join(format!("p2p-ar-build-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let mut other = Identity::of_this_process(1, 2);
        other.build ^= 0x5a5a;
        other.pid += 1;
        // Written by this (live) process, as a peer running now would.
        let start = std::fs::read_to_string("/proc/self/stat")
            .ok()
            .and_then(|s| {
                let rest = s[s.rfind(')')? + 1..].to_string();
                rest.split_whitespace().nth(19)?.parse::<u64>().ok()
            })
            .unwrap_or(0);
        forge_dir_record(&dir, 1, 1, std::process::id(), start, &other.encode());
        let timeout = Duration::from_secs(5);
        let ex = DirExchange::new(&dir, 0, 2, timeout).expect("new");
        let t = std::time::Instant::now();
        match introduce(&ex) {
            Err(Error::GroupMismatch {
                rank: 0,
                other: 1,
                what,
            }) => {
                assert!(what.contains("another build"), "{what}")
            }
            other => panic!("expected GroupMismatch, got {other:?}"),
        }
        assert!(t.elapsed() < Duration::from_secs(1), "{:?}", t.elapsed());
        // A new group in the same directory: both ranks fresh (the new
        // rank 1 replaces its records first, as a restarted rank does).
        let exs: Vec<DirExchange> = [1usize, 0]
            .iter()
            .map(|&r| DirExchange::new(&dir, r, 2, timeout).expect("new"))
            .collect();
        let hs: Vec<_> = exs
            .into_iter()
            .map(|ex| {
                std::thread::spawn(move || {
                    let r = ex.rank();
                    let mut me = Identity::of_this_process(r, 2);
                    me.pid += r as u32; // two ranks of one test process
                    introduce_as(&ex, &me)
                })
            })
            .collect();
        for h in hs {
            let ids = h.join().expect("thread").expect("a new group meets");
            assert_eq!(ids.len(), 2);
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn ranks_in_one_process_or_out_of_place_are_refused() {
        let mut twin = id(1, 2, "h", "b");
        twin.pid = 1000;
        for g in meet(vec![id(0, 2, "h", "b"), twin]) {
            assert!(
                matches!(&g, Err(Error::GroupMismatch { what, .. }) if what.contains("one process")),
                "{g:?}"
            );
        }
        let mut wrong = id(1, 2, "h", "b");
        wrong.rank = 0;
        for g in meet(vec![id(0, 2, "h", "b"), wrong]) {
            assert!(matches!(g, Err(Error::GroupMismatch { .. })), "{g:?}");
        }
    }
}
