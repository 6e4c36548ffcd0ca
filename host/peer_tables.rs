//! Zero-copy pointer tables of a [`crate::ProcessGroup`]: which peer
//! allocation each zero-copy allreduce reads, learnt by exchanging CUDA IPC
//! handles of the users' own buffers.
//!
//! Two ways a user buffer becomes readable by the peers:
//! - **captured**: an allreduce captured in a CUDA graph takes a table slot
//!   that is still zero (a replay before registration is reported as
//!   `Error::Unregistered`); `register_captured` fills every pending slot;
//! - **registered**: `register_buffer` exchanges one buffer per rank up
//!   front; an eager allreduce whose input lies inside it gets a table for
//!   its offset (made once per offset, outside capture).
//!
//! Invariants:
//! - every table lives in `slots` (allocated up front, zeroed), one
//!   `RankTable` each, and is written only while no kernel can read it
//!   (a fresh slot) or before the first replay (captured slots);
//! - each peer allocation is opened once per (peer, handle) and stays mapped
//!   as long as the group lives, so a table never names unmapped memory;
//! - a registered range's `common` is the smallest length any rank
//!   registered: an allreduce at offset `o` of `n` bytes is allowed only if
//!   `o + n <= common`, so a peer read stays inside every rank's buffer even
//!   when the ranks disagree about the call;
//! - a peer's record is trusted only as far as its mapping goes: the
//!   buffer it claims (offset and length) must lie inside the allocation
//!   `cuIpcOpenMemHandle` mapped (its size as the driver reports it), or
//!   the registration fails with `Error::PeerBufferTooSmall` on every rank
//!   (a round after the mapping tells the ranks how it went) and no table
//!   names it.

use crate::abi::{RankTable, MAX_RANKS};
use crate::checks::check_aligned;
use crate::driver::{self, DeviceAlloc, IpcMapping};
use crate::error::{Error, Result};
use crate::exchange::{agree_setup, Exchange};
use crate::ipc::{check_mapped, Forgery, HANDLE};
use cudarc::driver::CudaContext;
use std::sync::Arc;

/// How many zero-copy tables (captured allreduces plus registered offsets)
/// one `ProcessGroup` can hold.
pub const TABLE_SLOTS: usize = 4096;

/// One record of an exchange: IPC handle of the allocation, offset of the
/// buffer inside it, bytes of the buffer.
const RECORD: usize = HANDLE + 16;

/// A buffer record: `handle`, then `offset` and `bytes` (little endian).
fn encode_record(handle: &[u8; HANDLE], offset: u64, bytes: u64) -> [u8; RECORD] {
    let mut rec = [0u8; RECORD];
    rec[..HANDLE].copy_from_slice(handle);
    rec[HANDLE..HANDLE + 8].copy_from_slice(&offset.to_le_bytes());
    rec[HANDLE + 8..].copy_from_slice(&bytes.to_le_bytes());
    rec
}

/// Rank `peer`'s buffer record `rec`: (handle, offset, bytes), or
/// `Error::Rendezvous` where it is not `RECORD` bytes long. The numbers
/// are as sent: [`check_mapped`] checks them against the mapping.
fn decode_record(peer: usize, rec: &[u8]) -> Result<([u8; HANDLE], u64, u64)> {
    let malformed = || {
        Error::Rendezvous(format!(
            "rank {peer} sent a malformed buffer record ({} bytes, not {RECORD}): run the same build on every rank",
            rec.len()
        ))
    };
    if rec.len() != RECORD {
        return Err(malformed());
    }
    let handle: [u8; HANDLE] = rec[..HANDLE].try_into().map_err(|_| malformed())?;
    let word = |at: usize| -> Result<u64> {
        let b: [u8; 8] = rec[at..at + 8].try_into().map_err(|_| malformed())?;
        Ok(u64::from_le_bytes(b))
    };
    Ok((handle, word(HANDLE)?, word(HANDLE + 8)?))
}

pub(crate) struct PeerTables {
    ctx: Arc<CudaContext>,
    rank: usize,
    world: usize,
    /// The staged table: scratch and signals every zero-copy table copies.
    base: RankTable,
    slots: DeviceAlloc,
    used: usize,
    pending: Vec<Pending>,
    registered: Vec<Registered>,
    opened: Vec<(usize, [u8; HANDLE], IpcMapping)>,
    /// What this rank's records forge (tests of the peers' checks only).
    forgery: Forgery,
}

/// A captured allreduce waiting for `register_captured`.
struct Pending {
    slot: usize,
    input: u64,
    record: [u8; RECORD],
}

/// A buffer registered by every rank with `register_buffer`.
struct Registered {
    /// This rank's buffer.
    start: u64,
    /// Every rank's buffer, mapped into this context (this rank's is `start`).
    peers: [u64; MAX_RANKS],
    /// The smallest length any rank registered.
    common: u64,
    /// Tables made so far: (offset, slot).
    tables: Vec<(u64, usize)>,
}

impl PeerTables {
    pub(crate) fn new(
        ctx: &Arc<CudaContext>,
        rank: usize,
        world: usize,
        base: RankTable,
        forgery: Forgery,
    ) -> Result<Self> {
        Ok(PeerTables {
            ctx: ctx.clone(),
            rank,
            world,
            base,
            slots: DeviceAlloc::zeroed(ctx, TABLE_SLOTS * std::mem::size_of::<RankTable>())?,
            used: 0,
            pending: Vec::new(),
            registered: Vec::new(),
            opened: Vec::new(),
            forgery,
        })
    }

    fn slot_ptr(&self, slot: usize) -> u64 {
        self.slots.ptr() + (slot * std::mem::size_of::<RankTable>()) as u64
    }

    fn take_slot(&mut self) -> Result<usize> {
        if self.used == TABLE_SLOTS {
            return Err(Error::Config(format!(
                "this ProcessGroup holds {TABLE_SLOTS} zero-copy tables (captured allreduces and registered \
                 offsets) already: create a new group, or use fewer distinct offsets into registered buffers"
            )));
        }
        self.used += 1;
        Ok(self.used - 1)
    }

    /// The exchange record of the user buffer `ptr` of `bytes` bytes:
    /// IPC handle of its allocation, offset, length (`registered`: of a
    /// registered buffer, else of a captured allreduce's input).
    fn record(
        &self,
        what: &'static str,
        ptr: u64,
        bytes: u64,
        registered: bool,
    ) -> Result<[u8; RECORD]> {
        check_aligned(what, self.rank, ptr)?;
        let (base, size) = driver::address_range(&self.ctx, ptr)?;
        let offset = ptr - base;
        let room = (size as u64).saturating_sub(offset);
        if bytes > room {
            return Err(Error::BufferTooSmall {
                what,
                rank: self.rank,
                len: room as usize,
                need: bytes as usize,
            });
        }
        let handle = driver::ipc_export(&self.ctx, base)?;
        let claimed_bytes = if registered {
            bytes.wrapping_add(self.forgery.record_bytes)
        } else {
            bytes
        };
        Ok(encode_record(
            &handle,
            offset.wrapping_add(self.forgery.record_offset),
            claimed_bytes,
        ))
    }

    /// Maps rank `peer`'s buffer (its `what`) described by `rec`, opening
    /// its allocation once, and checks that the buffer lies inside the
    /// mapping; returns its address here, with its length.
    fn open(&mut self, peer: usize, rec: &[u8], what: &'static str) -> Result<(u64, u64)> {
        let (handle, offset, bytes) = decode_record(peer, rec)?;
        let (base, mapped) = match self
            .opened
            .iter()
            .find(|(r, h, _)| *r == peer && *h == handle)
        {
            Some((_, _, m)) => (m.ptr(), m.bytes()),
            None => {
                let m = IpcMapping::open(&self.ctx, &handle)?;
                let (ptr, mapped) = (m.ptr(), m.bytes());
                // A mapping no record can use is not kept (dropping it unmaps it).
                check_mapped(self.rank, peer, what, offset, bytes, mapped)?;
                self.opened.push((peer, handle, m));
                (ptr, mapped)
            }
        };
        check_mapped(self.rank, peer, what, offset, bytes, mapped)?;
        Ok((base + offset, bytes))
    }

    /// Every rank's records, each checked to hold `n` records.
    fn gather(&self, exchange: &dyn Exchange, mine: &[u8], what: &str) -> Result<Vec<Vec<u8>>> {
        let all = exchange.all_gather(mine)?;
        if all.len() != self.world {
            return Err(Error::Rendezvous(format!(
                "the exchange returned {} records for a group of {} ranks",
                all.len(),
                self.world
            )));
        }
        for (r, b) in all.iter().enumerate() {
            if b.len() != mine.len() {
                return Err(Error::GroupMismatch {
                    rank: self.rank,
                    other: r,
                    what: format!(
                        "it {what} {}, this rank {}",
                        b.len() / RECORD,
                        mine.len() / RECORD
                    ),
                });
            }
        }
        Ok(all)
    }

    /// Writes `table` into `slot`.
    fn write(&self, slot: usize, table: &RankTable) -> Result<()> {
        // SAFETY: the slot lies inside `slots`, a live allocation of this
        // context; RankTable is plain data. No kernel reads the slot yet.
        unsafe { driver::write_at(&self.ctx, self.slot_ptr(slot), std::slice::from_ref(table)) }
    }

    /// Captures an allreduce reading `input` (`bytes` bytes): `launch` gets
    /// the device address of a zero slot; the slot is kept (pending
    /// `register_captured`) only if the launch succeeds.
    pub(crate) fn capture<T>(
        &mut self,
        input: u64,
        bytes: u64,
        launch: impl FnOnce(u64) -> Result<T>,
    ) -> Result<T> {
        let record = self.record("input", input, bytes, false)?;
        if self.used == TABLE_SLOTS {
            self.take_slot()?;
        }
        let out = launch(self.slot_ptr(self.used))?;
        let slot = self.take_slot()?;
        self.pending.push(Pending {
            slot,
            input,
            record,
        });
        Ok(out)
    }

    /// Fills the slots of every allreduce captured since the last call, after
    /// exchanging their buffers' handles. Returns how many. Each peer's
    /// buffer is mapped and checked first and the ranks then tell each
    /// other how that went: a slot is filled only where every rank could
    /// fill its own. On an error the captured allreduces are dropped on
    /// every rank (their slots stay zero: a replay is `Error::Unregistered`).
    pub(crate) fn register_captured(&mut self, exchange: &dyn Exchange) -> Result<usize> {
        let pending = std::mem::take(&mut self.pending);
        let mine: Vec<u8> = pending.iter().flat_map(|p| p.record).collect();
        let all = self.gather(exchange, &mine, "captured allreduces:")?;
        for (i, p) in pending.iter().enumerate() {
            let need = &p.record[HANDLE + 8..];
            for (r, b) in all.iter().enumerate() {
                if &b[(i + 1) * RECORD - 8..(i + 1) * RECORD] != need {
                    return Err(Error::GroupMismatch {
                        rank: self.rank,
                        other: r,
                        what: format!(
                            "its captured allreduce {i} reads a different number of bytes"
                        ),
                    });
                }
            }
        }
        let local = pending
            .iter()
            .enumerate()
            .map(|(i, p)| {
                let mut t = RankTable {
                    inputs: [0; MAX_RANKS],
                    ..self.base
                };
                for (r, b) in all.iter().enumerate() {
                    t.inputs[r] = if r == self.rank {
                        p.input
                    } else {
                        self.open(r, &b[i * RECORD..(i + 1) * RECORD], "captured input")?
                            .0
                    };
                }
                Ok(t)
            })
            .collect::<Result<Vec<_>>>();
        let tables = agree_setup(exchange, "registering captured allreduces", local)?;
        for (p, t) in pending.iter().zip(&tables) {
            self.write(p.slot, t)?;
        }
        Ok(pending.len())
    }

    /// Registers this rank's buffer `ptr` of `bytes` bytes with every other
    /// rank's (a collective call). Returns the buffer's index. Each peer's
    /// buffer is mapped and checked, then the ranks tell each other how
    /// that went: the buffer is registered on every rank or on none.
    pub(crate) fn register_buffer(
        &mut self,
        exchange: &dyn Exchange,
        ptr: u64,
        bytes: u64,
    ) -> Result<usize> {
        if !self.pending.is_empty() {
            return Err(Error::Config(
                "register_buffer while captured allreduces wait for register_captured: register them first".into(),
            ));
        }
        let mine = self.record("registered buffer", ptr, bytes, true)?;
        let all = self.gather(exchange, &mine, "registered buffers:")?;
        let local = (|| {
            let mut peers = [0u64; MAX_RANKS];
            let mut common = bytes;
            for (r, b) in all.iter().enumerate() {
                if r == self.rank {
                    peers[r] = ptr;
                    continue;
                }
                let (p, n) = self.open(r, b, "registered buffer")?;
                peers[r] = p;
                common = common.min(n);
            }
            Ok((peers, common))
        })();
        let (peers, common) = agree_setup(exchange, "registering a buffer", local)?;
        self.registered.push(Registered {
            start: ptr,
            peers,
            common,
            tables: Vec::new(),
        });
        Ok(self.registered.len() - 1)
    }

    /// Whether `input` lies inside a buffer registered by `register_buffer`.
    pub(crate) fn is_registered(&self, input: u64) -> bool {
        self.registered
            .iter()
            .any(|r| input >= r.start && input < r.start + r.common.max(1))
    }

    /// The table of a zero-copy allreduce reading `bytes` bytes at `input`,
    /// inside a registered buffer; made (a synchronous write) at the first
    /// call for its offset, so not during capture.
    pub(crate) fn registered_table(
        &mut self,
        input: u64,
        bytes: u64,
        capturing: bool,
    ) -> Result<u64> {
        let Some(i) = self
            .registered
            .iter()
            .position(|r| input >= r.start && input < r.start + r.common.max(1))
        else {
            return Err(Error::NotRegistered {
                rank: self.rank,
                ptr: input,
            });
        };
        let offset = input - self.registered[i].start;
        let common = self.registered[i].common;
        if offset + bytes > common {
            return Err(Error::BufferTooSmall {
                what: "registered buffer (the smallest any rank registered)",
                rank: self.rank,
                len: (common - offset) as usize,
                need: bytes as usize,
            });
        }
        if let Some(&(_, slot)) = self.registered[i].tables.iter().find(|(o, _)| *o == offset) {
            return Ok(self.slot_ptr(slot));
        }
        if capturing {
            return Err(Error::Config(format!(
                "offset {offset} of a registered buffer is used for the first time during graph capture; \
                 run it once outside capture first, or capture it with allreduce_in_graph"
            )));
        }
        let slot = self.take_slot()?;
        let r = &self.registered[i];
        let mut t = RankTable {
            inputs: [0; MAX_RANKS],
            ..self.base
        };
        for (dst, &p) in t.inputs.iter_mut().zip(&r.peers).take(self.world) {
            *dst = p + offset;
        }
        self.write(slot, &t)?;
        self.registered[i].tables.push((offset, slot));
        Ok(self.slot_ptr(slot))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig {
            cases: 2000,
            failure_persistence: None,
            ..ProptestConfig::default()
        })]

        /// Issue 48: a buffer record of any length and bytes decodes (a
        /// whole record) or is a typed error naming the sender, never a
        /// panic; what decodes is what was encoded.
        #[test]
        fn buffer_records_decode_or_are_typed(
            b in proptest::collection::vec(any::<u8>(), 0..RECORD * 2),
            handle in proptest::collection::vec(any::<u8>(), HANDLE),
            offset in any::<u64>(),
            bytes in any::<u64>(),
            cut in 0usize..=RECORD,
        ) {
            match decode_record(3, &b) {
                Ok(_) => prop_assert_eq!(b.len(), RECORD),
                Err(Error::Rendezvous(m)) => {
                    prop_assert!(b.len() != RECORD);
                    prop_assert!(m.contains("rank 3"), "{}", m);
                }
                Err(e) => return Err(TestCaseError::fail(format!("untyped: {e:?}"))),
            }
            let h: [u8; HANDLE] = handle.as_slice().try_into().map_err(|_| TestCaseError::fail("handle"))?;
            let rec = encode_record(&h, offset, bytes);
            let back = decode_record(1, &rec)
                .map_err(|e| TestCaseError::fail(format!("round trip: {e}")))?;
            prop_assert_eq!(back, (h, offset, bytes));
            prop_assert_eq!(decode_record(1, &rec[..cut]).is_ok(), cut == RECORD);
        }

        /// What a peer's record claims is checked against its mapping: a
        /// claim is taken exactly when `offset + bytes` (past u64::MAX
        /// too) lies inside the mapped allocation.
        #[test]
        fn claims_past_the_mapping_are_refused(
            offset in prop_oneof![any::<u64>(), 0u64..(1 << 21), Just(u64::MAX)],
            bytes in prop_oneof![any::<u64>(), 0u64..(1 << 21), Just(u64::MAX)],
            mapped in prop_oneof![any::<u64>(), 0u64..(1 << 22)],
            edge in proptest::option::of(-1i64..=1),
        ) {
            // Half the cases at the mapping's end: one byte short, exact, one byte past.
            let mapped = match (edge, offset.checked_add(bytes)) {
                (Some(d), Some(end)) => end.saturating_add_signed(d),
                _ => mapped,
            };
            let rec = encode_record(&[9; HANDLE], offset, bytes);
            let (_, o, n) = decode_record(1, &rec)
                .map_err(|e| TestCaseError::fail(format!("{e}")))?;
            let got = check_mapped(0, 1, "registered buffer", o, n, mapped);
            prop_assert_eq!(got.is_ok(), offset.checked_add(bytes).is_some_and(|e| e <= mapped));
            if let Err(e) = got {
                let typed = matches!(
                    e,
                    Error::PeerBufferTooSmall { rank: 0, peer: 1, what: "registered buffer", .. }
                );
                prop_assert!(typed, "{:?}", e);
            }
        }
    }
}
