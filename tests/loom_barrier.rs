//! A loom model of the kernels' barrier protocol, run with the very code the
//! kernels use (`device::barrier::{arrive_ordered, wait_ordered, next_epoch}`,
//! whose waits accept the awaited epoch or the next one
//! (`device::barrier::reached`), and the `FlagWord` / `Clock` traits), on
//! loom atomics instead of GPU memory.
//!
//! # What is modelled
//!
//! Each rank is one loom thread running a sequence of "stream operations":
//! per collective, a copy of the rank's new input into its buffer, then one
//! kernel of the algorithm ([`Protocol::algo`]):
//! - one-stage: start barrier, reads of every rank's input, end barrier;
//! - two-stage: start barrier, reads of every rank's input for its own
//!   partition, written into its scratch, mid barrier, peers' partitions
//!   from their scratch;
//! - push: its input into its part of every peer's landing zone, slot
//!   `epoch % 2` as in the kernels (`allreduce_push`), start barrier, then
//!   the sum, in rank order, of its own input and the peers' parts of its
//!   own landing zone.
//! - push_ll: no barrier; its input, as flag-in-data packs
//!   (`device::ll::encode`, four 8-byte words each carrying the epoch),
//!   into its part of every peer's LL zone (slot `epoch % 2`), then, per
//!   pack and source in rank order, the kernels' own wait
//!   (`device::ll::wait_pack`) on its own zone and the sum. Each word is a
//!   relaxed loom `AtomicU64`, loaded and stored one by one: PTX models a
//!   vector access as independent accesses of its elements, so a reader
//!   may see any subset of a pack's new words.
//!
//! Which barriers run and with which order is read from the protocol table
//! the kernels use (`device::barrier::{barriers, order}`,
//! [`Protocol::kernels`]): today Start relaxed (`Order::ArrivalOnly`) in
//! the pull algorithms and release/acquire (`Order::Publish`) in push, End
//! relaxed, Mid release/acquire, no End in two-stage nor in push. The
//! must-fail variants below change that table's protocol explicitly.
//!
//! Every value a rank reads (input, scratch, landing zone) and every
//! collective's result is checked. Consecutive collectives of a rank are
//! consecutive stream operations on its thread, so the kernels' argument
//! for reusing landing slot `e % 2` at `e + 2` (a peer starts kernel
//! `e + 1`, and arrives at its Start, only after its kernel `e`, with every
//! read of that slot, completed) is in the model as program order plus
//! `Hw::stream_order`; push's release/acquire Start alone already orders
//! those reads before the reuse.
//!
//! A block's "thread p exchanges flags with peer p" is folded into one
//! thread that first arrives at every peer and then waits for every peer,
//! which is what the `bar.sync` around the exchange makes of it (no arrival
//! ever waits on a wait). The model has one block: other blocks use other
//! flag words (and parts of the landing zones) and do not interact through
//! the protocol. Folding a block into one thread also assumes that every
//! write of the block before an arrival is ordered before it by a
//! `bar.sync`: for push's Start, the landing-zone writes of every thread
//! before the arrivals of threads `0..N`.
//!
//! Buffers are `loom::cell::UnsafeCell`s, so loom reports any read not
//! ordered (happens-before) with a write of the same buffer; on top of
//! that every value read is checked to belong to the right collective.
//!
//! # Hardware assumptions
//!
//! Relaxed flags give no happens-before edge in the C++/Rust memory model
//! that loom implements (nor in PTX's). The kernels' relaxed Start and End
//! rely on properties of the GPU and of CUDA streams instead. The model
//! states each as a fence, so each can be switched off to show that it is
//! load-bearing ([`Hw`]):
//! - `stream_order`: an operation on a stream (the input copy, a kernel)
//!   has completed, all its accesses performed, before the next operation
//!   on that stream starts: a release fence after the copy and after each
//!   kernel;
//! - `polls_gate_accesses`: accesses after a poll that saw the epoch (and
//!   the `bar.sync` after it) are performed after it, and do not see memory
//!   older than it: an acquire fence after a relaxed wait;
//! - `reads_done_before_end`: a rank's reads of peer inputs have returned
//!   (their values fed stores) before its End arrival: a release fence
//!   before a relaxed End arrival.
//!
//! The brief's protocol (release/acquire at every barrier, End in both
//! algorithms) needs none of them; it is checked too
//! ([`Protocol::release_acquire`]).

use loom::cell::UnsafeCell;
use loom::model::Builder;
use loom::sync::atomic::{fence, AtomicU32, AtomicU64, Ordering};
use loom::sync::Arc;
use p2p_allreduce::abi::{
    error_code, island_split, ll_highs, ll_tag, Algorithm, BarrierKind, ErrorRecord, LaunchArgs,
};
use p2p_allreduce::call_tag::CallDesc;
use p2p_allreduce::device::barrier::{
    arrive_ordered, barriers, islands_barriers, next_epoch, order, runs, wait_ordered, Clock,
    FlagWord, Order, Wait, POLLS_PER_CLOCK_READ,
};
use p2p_allreduce::device::ll::{self, Lines, PackSlot};
use p2p_allreduce::device::reduce::partition;

/// A flag word in loom's memory model: the epoch in the low half, the
/// writer's call tag in the high half (`abi::flag_word`).
struct Flag(AtomicU64);

impl FlagWord for Flag {
    fn load_acquire(&self) -> u64 {
        self.0.load(Ordering::Acquire)
    }
    fn store_release(&self, value: u64) {
        self.0.store(value, Ordering::Release)
    }
    fn load_relaxed(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
    fn store_relaxed(&self, value: u64) {
        self.0.store(value, Ordering::Relaxed)
    }
}

/// Time advances by a fixed step per reading, so a wait for a peer that
/// never comes ends after a bounded number of polls; each failed poll
/// yields, which lets loom run the other ranks.
struct StepClock {
    now: u64,
}

const NS_PER_CLOCK_READ: u64 = 1_000;

impl Clock for StepClock {
    fn now_ns(&mut self) -> u64 {
        self.now += NS_PER_CLOCK_READ;
        self.now
    }
    fn relax(&mut self) {
        loom::thread::yield_now();
    }
}

/// One pack of a push_ll landing zone: the four words of
/// `device::ll::Lines`, and a separate flag word that only the must-fail
/// layout [`LlLayout::FlagAfterData`] uses.
struct LlPack {
    words: [AtomicU64; 4],
    flag: AtomicU32,
}

/// Where a push_ll pack keeps its epoch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum LlLayout {
    /// The kernels': in every word, next to the data it vouches for.
    InEveryWord,
    /// A must-fail variant: plain data words, then one flag word stored
    /// after them (relaxed, as no fence is used), read before them.
    FlagAfterData,
}

/// A pack as the shared protocol code sees it.
struct LlView<'a> {
    pack: &'a LlPack,
    layout: LlLayout,
}

impl PackSlot for LlView<'_> {
    fn load(&self) -> Lines {
        let w = &self.pack.words;
        match self.layout {
            LlLayout::InEveryWord => {
                let l = |k: usize| w[k].load(Ordering::Relaxed);
                [[l(0), l(1)], [l(2), l(3)]]
            }
            LlLayout::FlagAfterData => {
                let f = (self.pack.flag.load(Ordering::Relaxed) as u64) << 32;
                let l = |k: usize| (w[k].load(Ordering::Relaxed) & 0xffff_ffff) | f;
                [[l(0), l(1)], [l(2), l(3)]]
            }
        }
    }
    fn store(&self, lines: Lines) {
        let w = &self.pack.words;
        let flat = [lines[0][0], lines[0][1], lines[1][0], lines[1][1]];
        match self.layout {
            LlLayout::InEveryWord => {
                for (k, v) in flat.into_iter().enumerate() {
                    w[k].store(v, Ordering::Relaxed);
                }
            }
            LlLayout::FlagAfterData => {
                for (k, v) in flat.into_iter().enumerate() {
                    w[k].store(v & 0xffff_ffff, Ordering::Relaxed);
                }
                self.pack
                    .flag
                    .store((flat[0] >> 32) as u32, Ordering::Relaxed);
            }
        }
    }
}

/// Data elements per push_ll pack in the model (one u32 per word).
const LL_LANES: usize = 4;

/// The error record a rank claims in its own signal, as the kernels do:
/// a compare-and-swap on the code claims it, then the fields are written.
struct ErrorSlot {
    code: AtomicU32,
    record: UnsafeCell<ErrorRecord>,
}

/// One rank's memory that peers can reach: a signal (one flag slot per
/// peer for each barrier kind), its input, its scratch, and (push) the
/// landing zone after the signal.
struct RankMem {
    world: usize,
    len: usize,
    start: Vec<Flag>,
    mid: Vec<Flag>,
    end: Vec<Flag>,
    back: Vec<Flag>,
    relay: Vec<Flag>,
    error: ErrorSlot,
    input: Vec<UnsafeCell<u32>>,
    scratch: Vec<UnsafeCell<u32>>,
    /// `[slot 0..2][source 0..world][element 0..len]`, as in the kernels
    /// (`abi::Signal::LANDING_OFFSET`), element-wise instead of in packs.
    landing: Vec<UnsafeCell<u32>>,
    /// push_ll: `[slot 0..2][source 0..world][pack]`, packs of
    /// [`LL_LANES`] elements (the kernels' `ll::slot` layout).
    ll: Vec<LlPack>,
}

impl RankMem {
    fn new(world: usize, len: usize) -> Self {
        let flags = || (0..world).map(|_| Flag(AtomicU64::new(0))).collect();
        let cells = |n| (0..n).map(|_| UnsafeCell::new(0)).collect();
        RankMem {
            world,
            len,
            start: flags(),
            mid: flags(),
            end: flags(),
            back: flags(),
            relay: flags(),
            error: ErrorSlot {
                code: AtomicU32::new(error_code::NONE),
                record: UnsafeCell::new(ErrorRecord::default()),
            },
            input: cells(len),
            scratch: cells(len),
            // Not `cells`: loom then names this line for a race here.
            landing: (0..2 * world * len).map(|_| UnsafeCell::new(0)).collect(),
            ll: (0..2 * world * len.div_ceil(LL_LANES))
                .map(|_| LlPack {
                    words: [0; 4].map(AtomicU64::new),
                    flag: AtomicU32::new(0),
                })
                .collect(),
        }
    }
    /// Pack `i` of source `src`'s part of the LL zone's slot for `epoch`.
    fn ll_pack(&self, epoch: u32, slots: u32, src: usize, i: usize) -> &LlPack {
        let packs = self.len.div_ceil(LL_LANES) as u64;
        // The kernels' layout (`ll::slot`), in packs instead of bytes, with
        // the slot count of the protocol (2 in the kernels).
        let part = if slots == 2 {
            ll::slot(epoch, self.world as u64, src as u64, packs)
        } else {
            ((epoch % slots) as u64 * self.world as u64 + src as u64) * packs
        };
        &self.ll[part as usize + i]
    }
    /// Element `i` of source `src`'s part of landing slot `slot`.
    fn landing(&self, slot: usize, src: usize, i: usize) -> &UnsafeCell<u32> {
        &self.landing[(slot * self.world + src) * self.len + i]
    }
    /// The slot that peer `from` writes in this signal.
    fn slot(&self, kind: BarrierKind, from: usize) -> &Flag {
        match kind {
            BarrierKind::Start => &self.start[from],
            BarrierKind::Mid => &self.mid[from],
            BarrierKind::End => &self.end[from],
            BarrierKind::Back => &self.back[from],
            BarrierKind::Relay => &self.relay[from],
        }
    }
}

/// The hardware and stream properties the relaxed barriers rely on; see
/// the module documentation.
#[derive(Clone, Copy, Debug)]
struct Hw {
    stream_order: bool,
    polls_gate_accesses: bool,
    reads_done_before_end: bool,
}

impl Hw {
    const ALL: Hw = Hw {
        stream_order: true,
        polls_gate_accesses: true,
        reads_done_before_end: true,
    };
    /// Only what the C++ memory model gives.
    const NONE: Hw = Hw {
        stream_order: false,
        polls_gate_accesses: false,
        reads_done_before_end: false,
    };
}

/// What to model.
#[derive(Clone, Copy, Debug)]
struct Protocol {
    world: usize,
    /// Elements per message (two-stage: split into `world` partitions).
    len: usize,
    collectives: u32,
    algo: Algorithm,
    /// `None` removes the barrier (each of the three).
    start: Option<Order>,
    /// Two-stage only: one-stage has no place for it.
    mid: Option<Order>,
    /// `None`: no end barrier.
    end: Option<Order>,
    /// push_islands only (`None` removes them).
    back: Option<Order>,
    relay: Option<Order>,
    hw: Hw,
    /// 0 waits forever, as in the kernels.
    timeout_ns: u64,
    /// The epoch counter's value before the first collective (0 in zeroed
    /// memory).
    epoch_before: u32,
    /// A rank that dies (leaves without a word, as `absent_ranks` makes a
    /// kernel do) just before it would arrive at the given barrier of the
    /// given collective.
    dies: Option<(usize, u32, BarrierKind)>,
    /// A rank that is late: it yields this many times before its first
    /// input copy. Under loom a yield hands the processor to the other
    /// ranks, so this is how a slow peer is modelled.
    late: Option<(usize, u32)>,
    /// Push only: landing-zone slots a rank cycles through, by epoch
    /// (`epoch % landing_slots`). The kernels use two (`epoch & 1`); one is
    /// a must-fail variant.
    landing_slots: u32,
    /// How a wait decides that a peer arrived.
    wait: WaitRule,
    /// push_ll only: where a pack keeps its epoch.
    ll_layout: LlLayout,
    /// push_ll only, a must-fail variant: every collective's packs carry
    /// this epoch instead of their own.
    ll_fixed_epoch: Option<u32>,
    /// The call tag each rank's words carry (`abi::flag_word`,
    /// `abi::ll_highs`); all equal unless ranks disagree about the call.
    tags: [u32; 4],
    /// A rank whose call has fewer elements than `len` (ranks that
    /// disagree about the count): `(rank, its len)`.
    short: Option<(usize, usize)>,
}

/// The arrival test of a wait.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum WaitRule {
    /// The kernels' [`wait_ordered`] as it is: the awaited epoch or the
    /// next one (`device::barrier::reached`).
    Reached,
    /// A must-fail variant: only the awaited epoch itself counts. Still
    /// the kernels' [`wait_ordered`], on a flag seen through [`Exactly`].
    Equality,
}

/// A flag as an equality wait sees it: any value other than the awaited
/// word reads as 0 (never written), so `reached` holds exactly when the
/// flag holds `word`. This turns the kernels' own wait loop into an
/// equality wait without copying it.
struct Exactly<'a> {
    flag: &'a Flag,
    word: u64,
}

impl FlagWord for Exactly<'_> {
    fn load_acquire(&self) -> u64 {
        self.flag.load_acquire()
    }
    fn store_release(&self, value: u64) {
        self.flag.store_release(value)
    }
    fn load_relaxed(&self) -> u64 {
        let v = self.flag.load_relaxed();
        if v == self.word {
            v
        } else {
            0
        }
    }
    fn store_relaxed(&self, value: u64) {
        self.flag.store_relaxed(value)
    }
}

/// The order the kernels' protocol table gives barrier `kind` in `algo`,
/// or `None` where the kernels run no such barrier.
const fn table_order(algo: Algorithm, kind: BarrierKind) -> Option<Order> {
    if runs(algo, kind) {
        Some(order(algo, kind))
    } else {
        None
    }
}

impl Protocol {
    /// The protocol of the kernels, from the table they use
    /// (`device::barrier::{barriers, order}`), under its hardware
    /// assumptions.
    const fn kernels(world: usize, len: usize, collectives: u32, algo: Algorithm) -> Self {
        Protocol {
            world,
            len,
            collectives,
            algo,
            start: table_order(algo, BarrierKind::Start),
            mid: table_order(algo, BarrierKind::Mid),
            end: table_order(algo, BarrierKind::End),
            back: table_order(algo, BarrierKind::Back),
            relay: table_order(algo, BarrierKind::Relay),
            hw: Hw::ALL,
            timeout_ns: 0,
            epoch_before: 0,
            dies: None,
            late: None,
            // One slot for push_two_stage and push_islands
            // (`barrier::barriers` says why).
            landing_slots: if matches!(algo, Algorithm::PushTwoStage | Algorithm::PushIslands) {
                1
            } else {
                2
            },
            wait: WaitRule::Reached,
            ll_layout: LlLayout::InEveryWord,
            ll_fixed_epoch: None,
            tags: [0; 4],
            short: None,
        }
    }

    /// The brief's protocol: release/acquire everywhere, an end barrier in
    /// both algorithms, nothing assumed of the hardware.
    const fn release_acquire(world: usize, len: usize, collectives: u32, algo: Algorithm) -> Self {
        Protocol {
            start: Some(Order::Publish),
            mid: if matches!(algo, Algorithm::TwoStage) {
                Some(Order::Publish)
            } else {
                None
            },
            end: Some(Order::Publish),
            hw: Hw::NONE,
            ..Self::kernels(world, len, collectives, algo)
        }
    }

    fn order(&self, kind: BarrierKind) -> Option<Order> {
        match kind {
            BarrierKind::Start => self.start,
            BarrierKind::Mid => self.mid,
            BarrierKind::End => self.end,
            BarrierKind::Back => self.back,
            BarrierKind::Relay => self.relay,
        }
    }
}

/// How a rank's run ended.
#[derive(Clone, Debug, PartialEq)]
enum Outcome {
    /// Every collective completed; the last one's result.
    Done(Vec<u32>),
    /// A barrier timed out: the record the rank left in its signal.
    Failed(ErrorRecord),
    /// The rank was told to die.
    Died,
}

/// Input of `rank` at element `i` in collective `c`: distinct for every
/// (collective, rank, element), so a stale or early read is visible.
fn input_value(c: u32, rank: usize, i: usize) -> u32 {
    1 + c * 10_000 + rank as u32 * 100 + i as u32
}

fn expected_sum(c: u32, world: usize, i: usize) -> u32 {
    (0..world).fold(0u32, |acc, r| acc.wrapping_add(input_value(c, r, i)))
}

fn record_error(mem: &RankMem, rank: usize, peer: usize, epoch: u32, kind: BarrierKind, tag: u32) {
    let claimed = mem
        .error
        .code
        .compare_exchange(
            error_code::NONE,
            error_code::PEER_TIMEOUT,
            Ordering::AcqRel,
            Ordering::Acquire,
        )
        .is_ok();
    if claimed {
        mem.error.record.with_mut(|r| {
            // SAFETY: only the rank that won the claim writes the record,
            // and it is read after the rank's thread is joined.
            unsafe {
                *r = ErrorRecord {
                    code: error_code::PEER_TIMEOUT,
                    rank: rank as u32,
                    block: 0,
                    peer: peer as u32,
                    epoch,
                    barrier: kind as u32,
                    tag,
                    _reserved: 0,
                }
            }
        });
    }
}

struct Rank<'a> {
    world: &'a [RankMem],
    me: usize,
    p: Protocol,
    clock: StepClock,
    /// The barriers this rank ran (arrived at), with their orders, in order.
    ran: Vec<(BarrierKind, Order)>,
}

enum Stop {
    Died,
    TimedOut,
}

impl<'a> Rank<'a> {
    fn new(world: &'a [RankMem], me: usize, p: Protocol) -> Self {
        Rank {
            world,
            me,
            p,
            clock: StepClock { now: 0 },
            ran: Vec::new(),
        }
    }

    /// Elements of this rank's call (`Protocol::short`).
    fn len(&self) -> usize {
        match self.p.short {
            Some((r, len)) if r == self.me => len,
            _ => self.p.len,
        }
    }

    /// The call tag this rank's words carry.
    fn tag(&self) -> u32 {
        self.p.tags[self.me]
    }

    /// This rank's flag word at `epoch` (`abi::flag_word`).
    fn word(&self, epoch: u32) -> u64 {
        epoch as u64 | (self.tag() as u64) << 32
    }

    /// This rank's LL high halves at `epoch` (`abi::ll_highs`).
    fn highs(&self, epoch: u32) -> ll::Highs {
        let a = LaunchArgs {
            call_tag: self.tag(),
            ..LaunchArgs::default()
        };
        ll_highs(epoch, &a, 0)
    }

    /// The end of a stream operation (input copy or kernel).
    fn stream_boundary(&self) {
        if self.p.hw.stream_order {
            fence(Ordering::Release);
        }
    }

    fn barrier(&mut self, c: u32, kind: BarrierKind, epoch: u32) -> Result<(), Stop> {
        self.barrier_among(c, kind, epoch, 0..self.p.world)
    }

    /// A barrier between the ranks of `among` only (push_islands' Relay),
    /// this rank one of them.
    fn barrier_among(
        &mut self,
        c: u32,
        kind: BarrierKind,
        epoch: u32,
        among: std::ops::Range<usize>,
    ) -> Result<(), Stop> {
        let Some(order) = self.p.order(kind) else {
            return Ok(());
        };
        if self.p.dies == Some((self.me, c, kind)) {
            return Err(Stop::Died);
        }
        self.ran.push((kind, order));
        let relaxed = order == Order::ArrivalOnly;
        if relaxed && kind == BarrierKind::End && self.p.hw.reads_done_before_end {
            fence(Ordering::Release);
        }
        // The kernels also exchange a flag with their own signal; it is
        // written and read by one thread in program order, so the model
        // leaves it out to keep loom's search small.
        for (peer, mem) in self.world.iter().enumerate() {
            if peer != self.me && among.contains(&peer) {
                arrive_ordered(mem.slot(kind, self.me), self.word(epoch), order);
            }
        }
        let own = &self.world[self.me];
        let mut failed = false;
        for peer in among.filter(|&p| p != self.me) {
            // Every peer is waited for, even after a timeout, as the
            // kernel's threads wait side by side.
            let flag = own.slot(kind, peer);
            let word = self.word(epoch);
            let (timeout, clock) = (self.p.timeout_ns, &mut self.clock);
            let w = match self.p.wait {
                WaitRule::Reached => wait_ordered(flag, word, timeout, clock, order),
                WaitRule::Equality => {
                    wait_ordered(&Exactly { flag, word }, word, timeout, clock, order)
                }
            };
            if w == Wait::TimedOut {
                record_error(own, self.me, peer, epoch, kind, self.tag());
                failed = true;
            }
        }
        if failed {
            return Err(Stop::TimedOut);
        }
        if relaxed && self.p.hw.polls_gate_accesses {
            fence(Ordering::Acquire);
        }
        Ok(())
    }

    fn read(cell: &UnsafeCell<u32>) -> u32 {
        // SAFETY: loom checks this read against every write of the cell.
        cell.with(|v| unsafe { *v })
    }

    fn write(cell: &UnsafeCell<u32>, value: u32) {
        // SAFETY: loom checks this write against every access of the cell.
        cell.with_mut(|v| unsafe { *v = value })
    }

    /// Reads element `i` of every rank's input, checking that each holds
    /// collective `c`'s value, and adds them.
    fn reduce(&self, c: u32, i: usize) -> u32 {
        let mut acc = 0u32;
        for (r, peer) in self.world.iter().enumerate() {
            let v = Self::read(&peer.input[i]);
            assert_eq!(
                v,
                input_value(c, r, i),
                "rank {} collective {c}: input {i} of rank {r} is stale: read before it was \
                 written for this collective, or after it was overwritten",
                self.me
            );
            acc = acc.wrapping_add(v);
        }
        acc
    }

    /// The landing slot of the collective with `epoch` (push).
    fn landing_slot(&self, epoch: u32) -> usize {
        (epoch % self.p.landing_slots) as usize
    }

    /// Push, phase 1: this rank's input into its part of every peer's
    /// landing zone (its own part is never written).
    fn push_to_peers(&self, epoch: u32) {
        let slot = self.landing_slot(epoch);
        let own = &self.world[self.me];
        for i in 0..self.len() {
            let v = Self::read(&own.input[i]);
            for (peer, mem) in self.world.iter().enumerate() {
                if peer != self.me {
                    Self::write(mem.landing(slot, self.me, i), v);
                }
            }
        }
    }

    /// Push, phase 2: element `i` of every source in rank order, its own
    /// from its input and the others' from its landing zone, checking that
    /// each holds collective `c`'s value, added.
    fn reduce_landed(&self, c: u32, epoch: u32, i: usize) -> u32 {
        let slot = self.landing_slot(epoch);
        let own = &self.world[self.me];
        let mut acc = 0u32;
        for src in 0..self.p.world {
            let v = if src == self.me {
                Self::read(&own.input[i])
            } else {
                Self::read(own.landing(slot, src, i))
            };
            assert_eq!(
                v,
                input_value(c, src, i),
                "rank {} collective {c}: landing slot {slot} part {src} element {i} is stale: \
                 read before rank {src} wrote it for this collective, or after it was \
                 overwritten",
                self.me
            );
            acc = acc.wrapping_add(v);
        }
        acc
    }

    /// The high halves push_ll packs of collective `epoch` carry.
    fn ll_epoch(&self, epoch: u32) -> ll::Highs {
        self.highs(self.p.ll_fixed_epoch.unwrap_or(epoch))
    }

    /// Pack `i` of this rank's input, zero past `len` (as the kernels'
    /// `ld_pack_upto`).
    fn own_ll_pack(&self, i: usize) -> [u32; 4] {
        let own = &self.world[self.me];
        let mut pack = [0u32; 4];
        for (k, v) in pack.iter_mut().enumerate() {
            if let Some(cell) = own.input.get(i * LL_LANES + k) {
                *v = Self::read(cell);
            }
        }
        pack
    }

    /// push_ll, phase 1: this rank's input, pack by pack, into its part of
    /// every peer's LL zone (its own part is never written).
    fn push_ll_to_peers(&self, epoch: u32) {
        for i in 0..self.len().div_ceil(LL_LANES) {
            let lines = ll::encode(self.own_ll_pack(i), self.ll_epoch(epoch));
            for (peer, mem) in self.world.iter().enumerate() {
                if peer != self.me {
                    let pack = mem.ll_pack(epoch, self.p.landing_slots, self.me, i);
                    LlView {
                        pack,
                        layout: self.p.ll_layout,
                    }
                    .store(lines);
                }
            }
        }
    }

    /// push_ll, phase 2: per pack, every source in rank order (its own
    /// from its input, the others waited for in its LL zone with the
    /// kernels' `ll::wait_pack`), each element checked to hold collective
    /// `c`'s value, added into `out`.
    fn reduce_ll(&mut self, c: u32, epoch: u32, out: &mut [u32]) -> Result<(), Stop> {
        let own = &self.world[self.me];
        for i in 0..self.len().div_ceil(LL_LANES) {
            let mut acc = [0u32; LL_LANES];
            for src in 0..self.p.world {
                let pack = if src == self.me {
                    self.own_ll_pack(i)
                } else {
                    let view = LlView {
                        pack: own.ll_pack(epoch, self.p.landing_slots, src, i),
                        layout: self.p.ll_layout,
                    };
                    let want = self.ll_epoch(epoch);
                    match ll::wait_pack(&view, want, self.p.timeout_ns, &mut self.clock) {
                        Some(p) => p,
                        None => {
                            record_error(own, self.me, src, epoch, BarrierKind::Start, self.tag());
                            return Err(Stop::TimedOut);
                        }
                    }
                };
                for (k, a) in acc.iter_mut().enumerate() {
                    let idx = i * LL_LANES + k;
                    if idx < self.len() {
                        assert_eq!(
                            pack[k],
                            input_value(c, src, idx),
                            "rank {} collective {c}: LL pack {i} of source {src} element {idx} \
                             is stale",
                            self.me
                        );
                        *a = a.wrapping_add(pack[k]);
                    }
                }
            }
            for (k, a) in acc.into_iter().enumerate() {
                if let Some(o) = out.get_mut(i * LL_LANES + k) {
                    *o = a;
                }
            }
        }
        Ok(())
    }

    /// PushTwoStage: partitions into their owners' landing zones, `Start`,
    /// the own partition reduced in rank order into the output and into
    /// every peer's zone, `Mid`, the peers' reduced partitions copied from
    /// the own zone. The kernels keep the two stages' data in separate
    /// regions of a part; here they are the same cells' disjoint indices
    /// (the owner's partition, then the source's own).
    fn push_two_stage(&mut self, c: u32, epoch: u32, out: &mut [u32]) -> Result<(), Stop> {
        let (n, len) = (self.p.world, self.len());
        let slot = self.landing_slot(epoch);
        let part = |p: usize| {
            let (s, e) = partition(len as u64, n as u32, p as u32);
            s as usize..e as usize
        };
        for (p, mem) in self.world.iter().enumerate().filter(|(p, _)| *p != self.me) {
            for i in part(p) {
                let v = Self::read(&self.world[self.me].input[i]);
                Self::write(mem.landing(slot, self.me, i), v);
            }
        }
        self.barrier(c, BarrierKind::Start, epoch)?;
        for i in part(self.me) {
            out[i] = self.reduce_landed(c, epoch, i);
            for (p, mem) in self.world.iter().enumerate() {
                if p != self.me {
                    Self::write(mem.landing(slot, self.me, i), out[i]);
                }
            }
        }
        self.barrier(c, BarrierKind::Mid, epoch)?;
        for owner in (0..n).filter(|&p| p != self.me) {
            for i in part(owner) {
                out[i] = Self::read(self.world[self.me].landing(slot, owner, i));
                assert_eq!(
                    out[i],
                    expected_sum(c, n, i),
                    "rank {} collective {c}: landing slot {slot} part {owner} element {i} is stale: \
                     read before rank {owner} wrote its reduced partition, or after it was overwritten",
                    self.me
                );
            }
        }
        Ok(())
    }

    /// Element `i` of source `src`'s share as this rank reads it: its own
    /// input, or its part of this rank's landing zone, checked to hold
    /// collective `c`'s value.
    fn landed(&self, c: u32, epoch: u32, src: usize, i: usize) -> u32 {
        let own = &self.world[self.me];
        let slot = self.landing_slot(epoch);
        let v = if src == self.me {
            Self::read(&own.input[i])
        } else {
            Self::read(own.landing(slot, src, i))
        };
        assert_eq!(
            v,
            input_value(c, src, i),
            "rank {} collective {c}: part {src} element {i} is stale",
            self.me
        );
        v
    }

    /// PushIslands (device/src/kernels/push_islands.rs): island A is ranks
    /// `0..h`, B ranks `h..n`; partition `i < h` is owned by A's rank `i`
    /// and its counterpart `h + i`. Each rank writes its island owners'
    /// partitions into their zones, `Start`; A's owners add their island's
    /// values and write the (here wrapping) partial into the counterpart's
    /// zone, `Mid`; B's owners add theirs on top and write the result into
    /// their output, the counterpart's zone and their island peers' zones,
    /// `Back`; B copies the other partitions and is done; A takes its
    /// result, relays it within A, `Relay` (among A); A copies the rest.
    /// Cells: a source's scatter writes land at the owner's partition's
    /// indices of the source's part, its gather (and crossing) writes at
    /// its own partition's indices, which never meet.
    fn push_islands(&mut self, c: u32, epoch: u32, out: &mut [u32]) -> Result<(), Stop> {
        let (n, len, me) = (self.p.world, self.len(), self.me);
        let h = island_split(n);
        let slot = self.landing_slot(epoch);
        let part = |q: usize| {
            let (s, e) = partition(len as u64, h as u32, q as u32);
            s as usize..e as usize
        };
        let (first, size) = if me < h { (0, h) } else { (h, n - h) };
        let idx = me - first;
        for k in 1..size {
            let q = (idx + k) % size;
            if q < h {
                for i in part(q) {
                    let v = Self::read(&self.world[me].input[i]);
                    Self::write(self.world[first + q].landing(slot, me, i), v);
                }
            }
        }
        self.barrier(c, BarrierKind::Start, epoch)?;
        if n == 1 {
            for (i, o) in out.iter_mut().enumerate() {
                *o = self.landed(c, epoch, 0, i);
            }
            return Ok(());
        }
        if me < h {
            for i in part(me) {
                let acc = (0..h).fold(0u32, |a, src| a.wrapping_add(self.landed(c, epoch, src, i)));
                Self::write(self.world[me + h].landing(slot, me, i), acc);
            }
        }
        self.barrier(c, BarrierKind::Mid, epoch)?;
        if me >= h && idx < h {
            let cp = me - h;
            for i in part(idx) {
                let partial = Self::read(self.world[me].landing(slot, cp, i));
                let want = (0..h).fold(0u32, |a, r| a.wrapping_add(input_value(c, r, i)));
                assert_eq!(
                    partial, want,
                    "rank {me} collective {c}: partial {i} from rank {cp} is stale"
                );
                let acc = (h..n).fold(partial, |a, src| {
                    a.wrapping_add(self.landed(c, epoch, src, i))
                });
                out[i] = acc;
                Self::write(self.world[cp].landing(slot, me, i), acc);
                for q in (h..n).filter(|&q| q != me) {
                    Self::write(self.world[q].landing(slot, me, i), acc);
                }
            }
        }
        self.barrier(c, BarrierKind::Back, epoch)?;
        // The other partitions (for A: first its own, from across): each
        // from its owner's part of this rank's zone.
        let copy = |owner: usize, q: usize, out: &mut [u32]| {
            for i in part(q) {
                out[i] = Self::read(self.world[me].landing(slot, owner, i));
                assert_eq!(
                    out[i],
                    expected_sum(c, n, i),
                    "rank {me} collective {c}: part {owner} element {i} is stale"
                );
            }
        };
        if me >= h {
            for q in (0..h).filter(|&q| h + q != me) {
                copy(h + q, q, out);
            }
            return Ok(());
        }
        copy(me + h, me, out);
        for p in (0..h).filter(|&p| p != me) {
            for i in part(me) {
                Self::write(self.world[p].landing(slot, me, i), out[i]);
            }
        }
        if h > 1 {
            self.barrier_among(c, BarrierKind::Relay, epoch, 0..h)?;
        }
        for q in (0..h).filter(|&q| q != me) {
            copy(q, q, out);
        }
        Ok(())
    }

    /// One kernel: the collective `c` with this rank's input in place.
    fn kernel(&mut self, c: u32, epoch: u32, out: &mut [u32]) -> Result<(), Stop> {
        let (n, len) = (self.p.world, self.len());
        if self.p.algo == Algorithm::PushLl {
            // No barrier: a rank told to die at Start leaves before it
            // sends anything, as `absent_ranks` makes the kernel do.
            if self.p.dies == Some((self.me, c, BarrierKind::Start)) {
                return Err(Stop::Died);
            }
            self.push_ll_to_peers(epoch);
            return self.reduce_ll(c, epoch, out);
        }
        if self.p.algo == Algorithm::PushTwoStage {
            return self.push_two_stage(c, epoch, out);
        }
        if self.p.algo == Algorithm::PushIslands {
            return self.push_islands(c, epoch, out);
        }
        if self.p.algo == Algorithm::Push {
            self.push_to_peers(epoch);
        }
        self.barrier(c, BarrierKind::Start, epoch)?;
        match self.p.algo {
            Algorithm::Push => {
                for (i, o) in out.iter_mut().enumerate() {
                    *o = self.reduce_landed(c, epoch, i);
                }
            }
            Algorithm::OneStage => {
                for (i, o) in out.iter_mut().enumerate() {
                    *o = self.reduce(c, i);
                }
            }
            Algorithm::PushLl | Algorithm::PushTwoStage | Algorithm::PushIslands => {
                unreachable!("returned above")
            }
            Algorithm::TwoStage => {
                let (s, e) = partition(len as u64, n as u32, self.me as u32);
                for (i, o) in out.iter_mut().enumerate().take(e as usize).skip(s as usize) {
                    *o = self.reduce(c, i);
                    Self::write(&self.world[self.me].scratch[i], *o);
                }
                self.barrier(c, BarrierKind::Mid, epoch)?;
                for k in 1..n {
                    let owner = (self.me + k) % n;
                    let (s, e) = partition(len as u64, n as u32, owner as u32);
                    for (i, o) in out.iter_mut().enumerate().take(e as usize).skip(s as usize) {
                        *o = Self::read(&self.world[owner].scratch[i]);
                        assert_eq!(
                            *o,
                            expected_sum(c, n, i),
                            "rank {} collective {c}: scratch {i} of rank {owner} is stale",
                            self.me
                        );
                    }
                }
            }
        }
        self.barrier(c, BarrierKind::End, epoch)
    }

    fn run(mut self) -> Outcome {
        self.run_collectives()
    }

    /// [`Rank::run`], also returning the barriers the rank ran.
    fn run_recorded(mut self) -> (Outcome, Vec<(BarrierKind, Order)>) {
        let outcome = self.run_collectives();
        (outcome, self.ran)
    }

    fn run_collectives(&mut self) -> Outcome {
        let mut epoch = self.p.epoch_before;
        let mut out = vec![0u32; self.len()];
        if let Some((rank, yields)) = self.p.late {
            if rank == self.me {
                for _ in 0..yields {
                    loom::thread::yield_now();
                }
            }
        }
        for c in 0..self.p.collectives {
            // The input copy: a stream operation before the kernel.
            for i in 0..self.len() {
                Self::write(&self.world[self.me].input[i], input_value(c, self.me, i));
            }
            self.stream_boundary();
            epoch = next_epoch(epoch);
            assert_ne!(epoch, 0, "epoch 0 would match zeroed flags");
            match self.kernel(c, epoch, &mut out) {
                Ok(()) => {}
                Err(Stop::Died) => return Outcome::Died,
                Err(Stop::TimedOut) => {
                    let own = &self.world[self.me];
                    assert_eq!(
                        own.error.code.load(Ordering::Acquire),
                        error_code::PEER_TIMEOUT
                    );
                    // SAFETY: this rank's record is written only by this rank.
                    return Outcome::Failed(own.error.record.with(|r| unsafe { *r }));
                }
            }
            self.stream_boundary();
            for (i, &o) in out.iter().enumerate() {
                let want = expected_sum(c, self.p.world, i);
                assert_eq!(o, want, "rank {} collective {c} element {i}", self.me);
            }
        }
        Outcome::Done(out)
    }
}

/// Runs every rank of `p` and returns their outcomes, in rank order: rank 0
/// on the model's main thread (one thread fewer for loom to interleave),
/// the others on loom threads. Joining every thread is the no-deadlock
/// check: loom fails an execution in which some thread can never finish.
fn run_world(p: Protocol) -> Vec<Outcome> {
    run_world_mem(p).0
}

/// [`run_world`], also returning the ranks' memory as they left it.
fn run_world_mem(p: Protocol) -> (Vec<Outcome>, Arc<Vec<RankMem>>) {
    let world: Arc<Vec<RankMem>> =
        Arc::new((0..p.world).map(|_| RankMem::new(p.world, p.len)).collect());
    let handles: Vec<_> = (1..p.world)
        .map(|me| {
            let world = world.clone();
            loom::thread::spawn(move || Rank::new(&world, me, p).run())
        })
        .collect();
    let first = Rank::new(&world, 0, p).run();
    let outcomes = std::iter::once(first)
        .chain(
            handles
                .into_iter()
                .map(|h| h.join().expect("rank thread panicked")),
        )
        .collect();
    (outcomes, world)
}

fn builder(preemptions: usize) -> Builder {
    let mut b = Builder::new();
    b.preemption_bound = Some(preemptions);
    // Every failed poll is a yield, i.e. a thread switch; three ranks
    // polling each other need more switches per execution than the default.
    b.max_branches = 20_000;
    b
}

/// Checks that every rank completed with the expected result.
fn check_all_done(p: &Protocol, outcomes: &[Outcome]) {
    let c = p.collectives - 1;
    let want: Vec<u32> = (0..p.len).map(|i| expected_sum(c, p.world, i)).collect();
    for (r, o) in outcomes.iter().enumerate() {
        assert_eq!(o, &Outcome::Done(want.clone()), "rank {r} of {p:?}");
    }
}

fn model_completes(p: Protocol, preemptions: usize) {
    builder(preemptions).check(move || {
        let outcomes = run_world(p);
        check_all_done(&p, &outcomes);
    });
}

// Search bounds. Loom's race check on the buffers compares vector clocks
// (happens-before), not the order in which the accesses happened to run, so
// a missing ordering edge is reported on any explored execution that
// performs both accesses; the preemption bound limits which schedules are
// tried, not what a race looks like. Every failed poll is a yield, at which
// loom branches over the other ranks, so the search grows fast with ranks:
// two ranks run with 2-3 preemptions, three ranks with none (with one, a
// three-rank one-stage model of a single collective had not finished after
// 10 minutes and 100k executions in a debug build; with none it takes ~1.5k
// executions).

#[test]
fn kernels_one_stage_two_ranks_two_collectives() {
    model_completes(Protocol::kernels(2, 2, 2, Algorithm::OneStage), 3);
}

#[test]
fn kernels_one_stage_three_ranks_two_collectives() {
    model_completes(Protocol::kernels(3, 1, 2, Algorithm::OneStage), 0);
}

/// Two collectives, so that scratch is reused without an end barrier.
#[test]
fn kernels_two_stage_two_ranks_two_collectives() {
    // Three elements: partitions of unequal size (2 and 1).
    model_completes(Protocol::kernels(2, 3, 2, Algorithm::TwoStage), 3);
}

#[test]
fn kernels_two_stage_three_ranks_two_collectives() {
    model_completes(Protocol::kernels(3, 3, 2, Algorithm::TwoStage), 0);
}

#[test]
fn release_acquire_one_stage_two_ranks_two_collectives() {
    model_completes(Protocol::release_acquire(2, 2, 2, Algorithm::OneStage), 2);
}

#[test]
fn release_acquire_two_stage_two_ranks_two_collectives() {
    model_completes(Protocol::release_acquire(2, 3, 2, Algorithm::TwoStage), 2);
}

/// Push: epochs 1, 2, 3 use landing slots 1, 0, 1, so the third collective
/// rewrites the slot the first one was reduced from, and a rank may be one
/// collective ahead of its peer (waits accept a later epoch).
#[test]
fn kernels_push_two_ranks_three_collectives() {
    model_completes(Protocol::kernels(2, 2, 3, Algorithm::Push), 3);
}

#[test]
fn kernels_push_three_ranks_three_collectives() {
    model_completes(Protocol::kernels(3, 1, 3, Algorithm::Push), 0);
}

/// The model runs exactly the kernels' barriers: the sequence of the
/// protocol table (`device::barrier::barriers`), in its order, each with the
/// table's order, in every collective. One rank alone runs its whole
/// sequence without waiting for anybody.
#[test]
fn model_runs_the_kernels_barrier_table() {
    for algo in Algorithm::ALL {
        let p = Protocol::kernels(1, 3, 2, algo);
        builder(0).check(move || {
            let world = vec![RankMem::new(1, p.len)];
            let (outcome, ran) = Rank::new(&world, 0, p).run_recorded();
            check_all_done(&p, &[outcome]);
            // push_islands runs a subsequence of its table by rank and
            // world (`islands_barriers`; one rank: Start only).
            let seq = if algo == Algorithm::PushIslands {
                let seq = islands_barriers(1, 0);
                assert!(seq.iter().all(|k| barriers(algo).contains(k)));
                seq
            } else {
                barriers(algo)
            };
            let want: Vec<(BarrierKind, Order)> = (0..p.collectives)
                .flat_map(|_| seq.iter().map(|&k| (k, order(algo, k))))
                .collect();
            assert_eq!(ran, want, "{}", algo.name());
        });
    }
}

/// Epochs wrap from u32::MAX to 2 (never 0, the value of zeroed flags;
/// 2 keeps the parity alternating), and the protocol still matches
/// arrivals across the wrap.
#[test]
fn epochs_wrap_past_zero() {
    assert_eq!(next_epoch(u32::MAX), 2);
    assert_eq!(next_epoch(0), 1);
    assert_eq!(next_epoch(41), 42);
    let p = Protocol {
        epoch_before: u32::MAX - 1,
        ..Protocol::kernels(2, 1, 3, Algorithm::OneStage)
    };
    model_completes(p, 2);
}

// ---------------------------------------------------------------------------
// Timeouts

/// Runs a model in which some rank dies or is late; `check` sees the
/// outcomes of every execution loom explores.
fn model_with_fault(p: Protocol, preemptions: usize, check: fn(&[Outcome])) {
    builder(preemptions).check(move || check(&run_world(p)));
}

fn timeout_record(rank: u32, peer: u32, epoch: u32, kind: BarrierKind) -> ErrorRecord {
    ErrorRecord {
        code: error_code::PEER_TIMEOUT,
        rank,
        block: 0,
        peer,
        epoch,
        barrier: kind as u32,
        tag: 0,
        _reserved: 0,
    }
}

const TIMEOUT_NS: u64 = NS_PER_CLOCK_READ / 2;

/// Rank 1 never arrives: rank 0 must not hang, and leaves a record naming
/// peer 1, the first epoch and the start barrier.
#[test]
fn dead_peer_at_start_times_out_with_record() {
    let p = Protocol {
        timeout_ns: TIMEOUT_NS,
        dies: Some((1, 0, BarrierKind::Start)),
        ..Protocol::kernels(2, 1, 1, Algorithm::OneStage)
    };
    model_with_fault(p, 2, |o| {
        assert_eq!(o[1], Outcome::Died);
        assert_eq!(
            o[0],
            Outcome::Failed(timeout_record(0, 1, 1, BarrierKind::Start))
        );
    });
}

/// Rank 1 completes the first collective and dies before the end barrier
/// of the second: rank 0 reports epoch 2 at the end barrier.
#[test]
fn dead_peer_at_end_times_out_with_record() {
    let p = Protocol {
        timeout_ns: TIMEOUT_NS,
        dies: Some((1, 1, BarrierKind::End)),
        ..Protocol::kernels(2, 1, 2, Algorithm::OneStage)
    };
    model_with_fault(p, 2, |o| {
        assert_eq!(o[1], Outcome::Died);
        assert_eq!(
            o[0],
            Outcome::Failed(timeout_record(0, 1, 2, BarrierKind::End))
        );
    });
}

/// Two-stage: rank 1 dies before the mid barrier; rank 0 names it there.
#[test]
fn dead_peer_at_mid_times_out_with_record() {
    let p = Protocol {
        timeout_ns: TIMEOUT_NS,
        dies: Some((1, 0, BarrierKind::Mid)),
        ..Protocol::kernels(2, 2, 1, Algorithm::TwoStage)
    };
    model_with_fault(p, 2, |o| {
        assert_eq!(o[1], Outcome::Died);
        assert_eq!(
            o[0],
            Outcome::Failed(timeout_record(0, 1, 1, BarrierKind::Mid))
        );
    });
}

/// A dead rank among three: both survivors time out, each naming it. The
/// survivors also wait for each other, which always succeeds.
#[test]
fn dead_peer_among_three_is_named_by_both_survivors() {
    let p = Protocol {
        timeout_ns: TIMEOUT_NS,
        dies: Some((2, 0, BarrierKind::Start)),
        ..Protocol::kernels(3, 1, 1, Algorithm::OneStage)
    };
    model_with_fault(p, 1, |o| {
        assert_eq!(o[2], Outcome::Died);
        for (r, out) in o.iter().enumerate().take(2) {
            let want = timeout_record(r as u32, 2, 1, BarrierKind::Start);
            assert_eq!(out, &Outcome::Failed(want), "rank {r}");
        }
    });
}

/// Two absent peers: the record is claimed once and keeps the first
/// failure (peer 1) whole, not a mix of both.
#[test]
fn first_timeout_claims_the_record() {
    let p = Protocol {
        timeout_ns: TIMEOUT_NS,
        ..Protocol::kernels(3, 1, 1, Algorithm::OneStage)
    };
    builder(0).check(move || {
        // Only rank 0 runs: ranks 1 and 2 never arrive.
        let world: Vec<RankMem> = (0..3).map(|_| RankMem::new(3, 1)).collect();
        let o = Rank::new(&world, 0, p).run();
        assert_eq!(
            o,
            Outcome::Failed(timeout_record(0, 1, 1, BarrierKind::Start))
        );
    });
}

/// A live but late peer: rank 1 starts after rank 0's timeout has passed.
/// Rank 0 must give up at the start barrier (it had already arrived at
/// rank 1, so rank 1 gets through the start barrier and reads rank 0's
/// input, which is still valid), and rank 1 must then give up at the end
/// barrier instead of waiting for a rank that left: every rank ends, with a
/// record naming the other one, and nobody reads a wrong value.
#[test]
fn late_peer_ends_in_consistent_timeouts() {
    let p = Protocol {
        timeout_ns: TIMEOUT_NS,
        // Rank 0 gives up after POLLS_PER_CLOCK_READ polls; be later.
        late: Some((1, 4 * POLLS_PER_CLOCK_READ)),
        ..Protocol::kernels(2, 1, 1, Algorithm::OneStage)
    };
    model_with_fault(p, 2, |o| {
        assert_eq!(
            o[0],
            Outcome::Failed(timeout_record(0, 1, 1, BarrierKind::Start))
        );
        assert_eq!(
            o[1],
            Outcome::Failed(timeout_record(1, 0, 1, BarrierKind::End))
        );
    });
}

/// A peer that is about as late as the timeout: loom explores both
/// endings. In each execution every rank must end, either done with the
/// right sum or with a record naming the other rank at a real barrier of
/// this collective; never a hang or a wrong read.
#[test]
fn barely_late_peer_ends_in_success_or_consistent_timeout() {
    use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
    static DONE: AtomicUsize = AtomicUsize::new(0);
    static FAILED: AtomicUsize = AtomicUsize::new(0);
    let p = Protocol {
        timeout_ns: TIMEOUT_NS,
        late: Some((1, POLLS_PER_CLOCK_READ)),
        ..Protocol::kernels(2, 1, 1, Algorithm::OneStage)
    };
    model_with_fault(p, 2, |o| {
        for (r, o) in o.iter().enumerate() {
            match o {
                Outcome::Done(v) => {
                    assert_eq!(v, &vec![expected_sum(0, 2, 0)], "rank {r}");
                    DONE.fetch_add(1, Relaxed);
                }
                Outcome::Failed(rec) => {
                    let kind = BarrierKind::from_u32(rec.barrier);
                    assert!(
                        matches!(kind, Some(BarrierKind::Start | BarrierKind::End)),
                        "{rec:?}"
                    );
                    let want = timeout_record(r as u32, 1 - r as u32, 1, kind.unwrap());
                    assert_eq!(rec, &want, "rank {r}");
                    FAILED.fetch_add(1, Relaxed);
                }
                Outcome::Died => panic!("rank {r} died but none was told to"),
            }
        }
    });
    let (done, failed) = (DONE.load(Relaxed), FAILED.load(Relaxed));
    assert!(
        done > 0 && failed > 0,
        "endings seen: {done} done, {failed} timed out"
    );
}

// ---------------------------------------------------------------------------
// The model can fail: each barrier and each hardware assumption is needed.

/// Runs a model that must fail, and returns loom's (or the model's) panic
/// message; panics if every execution passed.
fn model_failure(p: Protocol, preemptions: usize) -> String {
    let result = std::panic::catch_unwind(move || model_completes(p, preemptions));
    let payload = result.expect_err("the broken protocol passed: the model cannot detect it");
    if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else if let Some(s) = payload.downcast_ref::<&str>() {
        s.to_string()
    } else {
        String::from("<non-string panic>")
    }
}

/// A race on a buffer, as loom reports it, or a stale value, as the model
/// reports it.
fn assert_race(msg: &str) {
    assert!(
        msg.contains("Causality violation") || msg.contains("is stale"),
        "unexpected failure: {msg}"
    );
}

/// Without the end barrier a fast rank overwrites its input for the next
/// collective while a slow peer still reads it.
#[test]
fn one_stage_without_end_barrier_is_caught() {
    let p = Protocol {
        end: None,
        ..Protocol::kernels(2, 1, 2, Algorithm::OneStage)
    };
    assert_race(&model_failure(p, 2));
}

#[test]
fn one_stage_without_end_barrier_is_caught_with_three_ranks() {
    let p = Protocol {
        end: None,
        ..Protocol::kernels(3, 1, 2, Algorithm::OneStage)
    };
    assert_race(&model_failure(p, 0));
}

/// Without the mid barrier a rank reads a peer's scratch before the peer
/// wrote it.
#[test]
fn two_stage_without_mid_barrier_is_caught() {
    let p = Protocol {
        mid: None,
        ..Protocol::kernels(2, 2, 1, Algorithm::TwoStage)
    };
    assert_race(&model_failure(p, 2));
}

/// Mid must publish: the partial sums are written in the same kernel, so
/// no stream boundary orders them before a relaxed arrival.
#[test]
fn two_stage_with_relaxed_mid_is_caught() {
    let p = Protocol {
        mid: Some(Order::ArrivalOnly),
        ..Protocol::kernels(2, 2, 1, Algorithm::TwoStage)
    };
    assert_race(&model_failure(p, 2));
}

/// Under the C++ memory model alone the relaxed start barrier does not
/// order the input copy before the peers' reads: the kernels' Start relies
/// on `polls_gate_accesses`.
#[test]
fn relaxed_start_needs_polls_to_gate_accesses() {
    let p = Protocol {
        hw: Hw {
            polls_gate_accesses: false,
            ..Hw::ALL
        },
        ..Protocol::kernels(2, 1, 1, Algorithm::OneStage)
    };
    assert_race(&model_failure(p, 1));
}

/// The relaxed end barrier relies on the reads being done before arrival.
#[test]
fn relaxed_end_needs_reads_done_before_arrival() {
    let p = Protocol {
        hw: Hw {
            reads_done_before_end: false,
            ..Hw::ALL
        },
        ..Protocol::kernels(2, 1, 2, Algorithm::OneStage)
    };
    assert_race(&model_failure(p, 2));
}

/// The relaxed start barrier relies on the input copy (or whatever stream
/// work wrote the input) being complete before the kernel starts. The
/// same fence, at the end of a kernel, is what makes two-stage safe
/// without an end barrier: a rank's arrival at the next start barrier is
/// ordered after its stage-2 reads of peers' scratch only because the next
/// kernel starts after this one completed. (Kernels that overlap on one
/// rank, through programmatic dependent launch or several streams, would
/// break that; a separate test cannot isolate it in this model because
/// the two are one fence.)
#[test]
fn relaxed_start_needs_stream_order() {
    let p = Protocol {
        hw: Hw {
            stream_order: false,
            ..Hw::ALL
        },
        ..Protocol::kernels(2, 1, 1, Algorithm::OneStage)
    };
    assert_race(&model_failure(p, 1));
}

// ---------------------------------------------------------------------------
// Push: each part of the protocol is needed.

/// Push's Start must publish: the landing-zone writes are made in the same
/// kernel just before the arrival, so no stream boundary orders them before
/// a relaxed one, and a peer can reduce stale landing data.
#[test]
fn push_with_relaxed_start_is_caught() {
    let p = Protocol {
        start: Some(Order::ArrivalOnly),
        ..Protocol::kernels(2, 1, 1, Algorithm::Push)
    };
    assert_race(&model_failure(p, 1));
}

#[test]
fn push_with_relaxed_start_is_caught_with_three_ranks() {
    let p = Protocol {
        start: Some(Order::ArrivalOnly),
        ..Protocol::kernels(3, 1, 1, Algorithm::Push)
    };
    assert_race(&model_failure(p, 0));
}

/// With one landing slot, a rank that passed the Start barrier of the next
/// collective overwrites its part of a peer's zone while the peer still
/// reduces the previous collective from it.
#[test]
fn push_with_one_landing_slot_is_caught() {
    let p = Protocol {
        landing_slots: 1,
        ..Protocol::kernels(2, 1, 2, Algorithm::Push)
    };
    assert_race(&model_failure(p, 2));
}

/// A push peer can be one collective ahead: it saw this rank's arrival,
/// finished, started the next collective and overwrote its flag with the
/// next epoch before this rank's wait read it. A wait for equality misses
/// the arrival and (each rank waiting for the other) both ranks hang; with
/// a timeout, some execution ends in timeouts at Start. Every execution
/// still ends, each rank done with the right sums or timed out at Start.
#[test]
fn push_with_equality_wait_hangs() {
    use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
    static TIMED_OUT: AtomicUsize = AtomicUsize::new(0);
    let p = Protocol {
        wait: WaitRule::Equality,
        timeout_ns: TIMEOUT_NS,
        ..Protocol::kernels(2, 1, 2, Algorithm::Push)
    };
    model_with_fault(p, 1, |o| {
        for (r, o) in o.iter().enumerate() {
            match o {
                Outcome::Done(v) => assert_eq!(v, &vec![expected_sum(1, 2, 0)], "rank {r}"),
                Outcome::Failed(rec) => {
                    assert_eq!(rec.barrier, BarrierKind::Start as u32, "rank {r}: {rec:?}");
                    assert_eq!(rec.peer, 1 - r as u32, "rank {r}: {rec:?}");
                    TIMED_OUT.fetch_add(1, Relaxed);
                }
                Outcome::Died => panic!("rank {r} died but none was told to"),
            }
        }
    });
    assert!(
        TIMED_OUT.load(Relaxed) > 0,
        "no execution missed an arrival: the model cannot detect an equality wait"
    );
}

/// The control for [`push_with_equality_wait_hangs`]: the same model with
/// the kernels' wait (`reached`) never times out.
#[test]
fn push_with_timeout_never_times_out() {
    let p = Protocol {
        timeout_ns: TIMEOUT_NS,
        ..Protocol::kernels(2, 1, 2, Algorithm::Push)
    };
    model_completes(p, 2);
}

/// At the epoch wrap the landing slot still alternates: the slot is the
/// epoch's parity (`epoch & 1` in `allreduce_push`) and `next_epoch` goes
/// from `u32::MAX` (odd) to 2 (even), so collectives on both sides of the
/// wrap use different slots. (With a wrap to 1 both would use slot 1, as
/// [`push_with_one_landing_slot_is_caught`] shows one slot fails.)
#[test]
fn push_landing_slot_alternates_at_epoch_wrap() {
    assert_ne!(next_epoch(u32::MAX) % 2, u32::MAX % 2);
    let p = Protocol {
        epoch_before: u32::MAX - 1,
        ..Protocol::kernels(2, 1, 2, Algorithm::Push)
    };
    model_completes(p, 2);
}

// push_ll: the flag-in-data protocol (`device::ll`), no barrier.

#[test]
fn kernels_push_ll_two_ranks_three_collectives() {
    model_completes(Protocol::kernels(2, 2, 3, Algorithm::PushLl), 1);
}

/// Five elements: two packs, the second padded. (Search bounds for
/// push_ll: every poll is four atomic loads, each a branch point, so the
/// models stay smaller than push's: one preemption for two ranks and one
/// pack, none otherwise; loom still explores every value each relaxed load
/// may return, which is where a torn pack would show. No three-rank model:
/// with no barrier, what a rank reads from a peer depends on that peer's
/// writes and stream order only, so the protocol is pairwise; a three-rank
/// model of one collective did not finish in 5 minutes.)
#[test]
fn kernels_push_ll_two_ranks_two_packs() {
    model_completes(Protocol::kernels(2, 5, 1, Algorithm::PushLl), 0);
}

/// Across the epoch wrap the slots still alternate and equality still
/// tells this collective's packs from the ones two collectives back.
#[test]
fn push_ll_across_epoch_wrap() {
    let p = Protocol {
        epoch_before: u32::MAX - 2,
        ..Protocol::kernels(2, 1, 4, Algorithm::PushLl)
    };
    model_completes(p, 0);
}

/// A peer whose packs never come: the wait ends at the timeout with a
/// record naming it, the epoch and Start (the data is the arrival).
#[test]
fn push_ll_dead_peer_times_out_with_record() {
    let p = Protocol {
        timeout_ns: TIMEOUT_NS,
        dies: Some((1, 1, BarrierKind::Start)),
        ..Protocol::kernels(2, 1, 2, Algorithm::PushLl)
    };
    model_with_fault(p, 2, |o| {
        assert_eq!(o[1], Outcome::Died);
        assert_eq!(
            o[0],
            Outcome::Failed(timeout_record(0, 1, 2, BarrierKind::Start))
        );
    });
}

/// The control for the must-fail variants below: the kernels' protocol
/// with a timeout never times out.
#[test]
fn push_ll_with_timeout_never_times_out() {
    let p = Protocol {
        timeout_ns: TIMEOUT_NS,
        ..Protocol::kernels(2, 1, 3, Algorithm::PushLl)
    };
    model_completes(p, 0);
}

/// With one slot, a peer one collective ahead overwrites the pack this
/// rank still waits for with the next epoch's: equality never holds again
/// and the wait times out (or, without a timeout, hangs).
#[test]
fn push_ll_with_one_slot_is_caught() {
    let p = Protocol {
        landing_slots: 1,
        timeout_ns: TIMEOUT_NS,
        ..Protocol::kernels(2, 1, 2, Algorithm::PushLl)
    };
    let msg = model_failure(p, 2);
    assert!(
        msg.contains("Failed") || msg.contains("is stale"),
        "unexpected failure: {msg}"
    );
}

/// Packs that carry the same epoch in every collective: a pack left two
/// collectives back passes for this one's.
#[test]
fn push_ll_with_a_fixed_epoch_is_caught() {
    let p = Protocol {
        ll_fixed_epoch: Some(1),
        ..Protocol::kernels(2, 1, 3, Algorithm::PushLl)
    };
    assert_race(&model_failure(p, 2));
}

/// One flag word stored after plain data words, with no fence: a reader
/// can see the new flag and old data.
#[test]
fn push_ll_with_flag_after_data_is_caught() {
    let p = Protocol {
        ll_layout: LlLayout::FlagAfterData,
        ..Protocol::kernels(2, 1, 2, Algorithm::PushLl)
    };
    assert_race(&model_failure(p, 2));
}

// ---------------------------------------------------------------------------
// PushTwoStage: Start and Mid, both publishing; no End.

#[test]
fn kernels_push_two_stage_two_ranks_three_collectives() {
    model_completes(Protocol::kernels(2, 2, 3, Algorithm::PushTwoStage), 2);
}

/// One slot serves every collective: three collectives on two ranks, with
/// the kernels' single slot, and with more preemptions.
#[test]
fn kernels_push_two_stage_one_slot_three_collectives() {
    let p = Protocol::kernels(2, 2, 3, Algorithm::PushTwoStage);
    assert_eq!(p.landing_slots, 1);
    model_completes(p, 3);
}

#[test]
fn kernels_push_two_stage_three_ranks_two_collectives() {
    model_completes(Protocol::kernels(3, 3, 2, Algorithm::PushTwoStage), 0);
}

/// Mid must publish: the reduced partitions are written into the peers'
/// zones in the same kernel, just before the arrival.
#[test]
fn push_two_stage_with_relaxed_mid_is_caught() {
    let p = Protocol {
        mid: Some(Order::ArrivalOnly),
        ..Protocol::kernels(2, 2, 1, Algorithm::PushTwoStage)
    };
    assert_race(&model_failure(p, 2));
}

/// Without Mid a rank copies a peer's reduced partition before it lands.
#[test]
fn push_two_stage_without_mid_is_caught() {
    let p = Protocol {
        mid: None,
        ..Protocol::kernels(2, 2, 1, Algorithm::PushTwoStage)
    };
    assert_race(&model_failure(p, 2));
}

/// Start must publish: the partitions are written just before it.
#[test]
fn push_two_stage_with_relaxed_start_is_caught() {
    let p = Protocol {
        start: Some(Order::ArrivalOnly),
        ..Protocol::kernels(2, 2, 1, Algorithm::PushTwoStage)
    };
    assert_race(&model_failure(p, 2));
}

/// A dead peer at Mid: the survivor times out there and names it.
#[test]
fn push_two_stage_dead_peer_at_mid_times_out_with_record() {
    let p = Protocol {
        timeout_ns: 50,
        dies: Some((1, 0, BarrierKind::Mid)),
        ..Protocol::kernels(2, 2, 1, Algorithm::PushTwoStage)
    };
    model_with_fault(p, 1, |outcomes| {
        assert_eq!(outcomes[1], Outcome::Died);
        assert_eq!(
            outcomes[0],
            Outcome::Failed(timeout_record(0, 1, 1, BarrierKind::Mid))
        );
    });
}

// ---------------------------------------------------------------------------
// PushIslands: Start, Mid, Back between all ranks and Relay within island
// A, all publishing; no End.

#[test]
fn kernels_push_islands_two_ranks_three_collectives() {
    let p = Protocol::kernels(2, 2, 3, Algorithm::PushIslands);
    assert_eq!(p.landing_slots, 1);
    model_completes(p, 2);
}

/// Island B of two ranks (one owner, one that owns nothing).
#[test]
fn kernels_push_islands_three_ranks_two_collectives() {
    model_completes(Protocol::kernels(3, 3, 2, Algorithm::PushIslands), 0);
}

/// Runs the executions of `p` loom finds first, at most `executions` of
/// them: four ranks make the full search too long (over 4 minutes
/// without a preemption). Loom checks happens-before on every buffer
/// access of each execution it runs, so a missing ordering edge still
/// shows in the first execution that performs both accesses.
fn model_completes_bounded(p: Protocol, executions: usize) {
    let mut b = builder(0);
    b.max_permutations = Some(executions);
    b.check(move || {
        let outcomes = run_world(p);
        check_all_done(&p, &outcomes);
    });
}

/// Two islands of two: the Relay barrier within island A runs (bounded:
/// see `model_completes_bounded`).
#[test]
fn kernels_push_islands_four_ranks_two_collectives() {
    model_completes_bounded(Protocol::kernels(4, 2, 2, Algorithm::PushIslands), 1000);
}

/// Each rank runs the barriers `islands_barriers` says, with the table's
/// orders, in every collective.
#[test]
fn push_islands_ranks_run_their_barrier_sequences() {
    for world in [2usize, 3, 4] {
        let p = Protocol::kernels(world, 2, 2, Algorithm::PushIslands);
        let mut b = builder(0);
        b.max_permutations = Some(200);
        b.check(move || {
            let mem: Arc<Vec<RankMem>> =
                Arc::new((0..world).map(|_| RankMem::new(world, p.len)).collect());
            let handles: Vec<_> = (1..world)
                .map(|me| {
                    let mem = mem.clone();
                    loom::thread::spawn(move || Rank::new(&mem, me, p).run_recorded())
                })
                .collect();
            let mut runs = vec![Rank::new(&mem, 0, p).run_recorded()];
            runs.extend(handles.into_iter().map(|h| h.join().expect("rank")));
            let outcomes: Vec<Outcome> = runs.iter().map(|r| r.0.clone()).collect();
            check_all_done(&p, &outcomes);
            for (rank, (_, ran)) in runs.iter().enumerate() {
                let want: Vec<(BarrierKind, Order)> = (0..p.collectives)
                    .flat_map(|_| {
                        islands_barriers(world, rank)
                            .iter()
                            .map(|&k| (k, order(Algorithm::PushIslands, k)))
                    })
                    .collect();
                assert_eq!(ran, &want, "world {world} rank {rank}");
            }
        });
    }
}

/// Mid must publish: the partials are written across just before it.
#[test]
fn push_islands_with_relaxed_mid_is_caught() {
    let p = Protocol {
        mid: Some(Order::ArrivalOnly),
        ..Protocol::kernels(2, 2, 1, Algorithm::PushIslands)
    };
    assert_race(&model_failure(p, 2));
}

/// Without Back, island A copies its result before it comes back.
#[test]
fn push_islands_without_back_is_caught() {
    let p = Protocol {
        back: None,
        ..Protocol::kernels(2, 2, 1, Algorithm::PushIslands)
    };
    assert_race(&model_failure(p, 2));
}

/// Relay must publish: A's ranks relay their results just before it.
#[test]
fn push_islands_with_relaxed_relay_is_caught() {
    let p = Protocol {
        relay: Some(Order::ArrivalOnly),
        ..Protocol::kernels(4, 2, 1, Algorithm::PushIslands)
    };
    let result = std::panic::catch_unwind(move || model_completes_bounded(p, 300));
    let payload = result.expect_err("a relaxed Relay passed");
    let msg = payload
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_default();
    assert_race(&msg);
}

/// A dead counterpart at Back: the survivor times out there and names it.
#[test]
fn push_islands_dead_peer_at_back_times_out_with_record() {
    let p = Protocol {
        timeout_ns: 50,
        dies: Some((1, 0, BarrierKind::Back)),
        ..Protocol::kernels(2, 2, 1, Algorithm::PushIslands)
    };
    model_with_fault(p, 1, |outcomes| {
        assert_eq!(outcomes[1], Outcome::Died);
        assert_eq!(
            outcomes[0],
            Outcome::Failed(timeout_record(0, 1, 1, BarrierKind::Back))
        );
    });
}

/// Two ranks whose calls differ (issue 43): the engines' shapes, each rank
/// with the tag its real call has (`call_tag::CallDesc`) and the shorter
/// rank with fewer elements. Neither rank may end its call in `Done`: each
/// times out, and the word the peer left where it waited is the peer's
/// call at this epoch under the peer's tag, which is what the host turns
/// into `CallMismatch` (host/collective.rs, `other_call`).
fn ranks_that_disagree(algo: Algorithm, short: CallDesc, long: CallDesc) {
    let (ts, tl) = (short.tag(), long.tag());
    assert_ne!(ts, tl, "{short} vs {long}");
    let p = Protocol {
        timeout_ns: TIMEOUT_NS,
        tags: [ts, tl, 0, 0],
        short: Some((0, 1)),
        ..Protocol::kernels(2, 2, 1, algo)
    };
    builder(1).check(move || {
        let (outcomes, world) = run_world_mem(p);
        for (me, o) in outcomes.iter().enumerate() {
            let Outcome::Failed(rec) = o else {
                panic!("{algo:?}: rank {me} ended {o:?}, not in a timeout: {short} vs {long}");
            };
            let (peer, theirs) = (1 - me, [ts, tl][1 - me]);
            assert_eq!(rec.code, error_code::PEER_TIMEOUT);
            assert_eq!(rec.peer as usize, peer);
            assert_eq!(
                rec.tag,
                [ts, tl][me],
                "the record carries the waiter's own tag"
            );
            let kind = BarrierKind::from_u32(rec.barrier).expect("a barrier kind");
            let mem = &world[me];
            // What the host reads where the wait timed out.
            let left = if algo == Algorithm::PushLl {
                let pack = mem.ll_pack(rec.epoch, p.landing_slots, peer, 0);
                let w = |k: usize| (pack.words[k].load(Ordering::Acquire) >> 32) as u32;
                ll_tag([w(0), w(1), w(2), w(3)], rec.epoch)
            } else {
                let v = mem.slot(kind, peer).0.load(Ordering::Acquire);
                (v as u32 == rec.epoch).then_some((v >> 32) as u32)
            };
            assert_eq!(
                left,
                Some(theirs),
                "{algo:?}: rank {me} must see the peer's call"
            );
        }
    });
}

#[test]
fn ranks_that_disagree_never_complete_one_stage() {
    ranks_that_disagree(
        Algorithm::OneStage,
        CallDesc::plain(3 * 7168, p2p_allreduce::Dtype::Bf16, Algorithm::OneStage),
        CallDesc::plain(4 * 7168, p2p_allreduce::Dtype::Bf16, Algorithm::OneStage),
    );
}

#[test]
fn ranks_that_disagree_never_complete_two_stage() {
    ranks_that_disagree(
        Algorithm::TwoStage,
        CallDesc::plain(8192, p2p_allreduce::Dtype::F16, Algorithm::TwoStage),
        CallDesc::plain(2 * 8192, p2p_allreduce::Dtype::F16, Algorithm::TwoStage),
    );
}

#[test]
fn ranks_that_disagree_never_complete_push() {
    ranks_that_disagree(
        Algorithm::Push,
        CallDesc::plain(1000, p2p_allreduce::Dtype::F32, Algorithm::Push),
        CallDesc::plain(1256, p2p_allreduce::Dtype::F32, Algorithm::Push),
    );
}

#[test]
fn ranks_that_disagree_never_complete_push_ll() {
    ranks_that_disagree(
        Algorithm::PushLl,
        CallDesc::fused(3, 7168, p2p_allreduce::Dtype::Bf16, Algorithm::PushLl),
        CallDesc::fused(4, 7168, p2p_allreduce::Dtype::Bf16, Algorithm::PushLl),
    );
}

#[test]
fn ranks_that_disagree_never_complete_push_two_stage() {
    ranks_that_disagree(
        Algorithm::PushTwoStage,
        CallDesc::plain(
            3 * 7168,
            p2p_allreduce::Dtype::Bf16,
            Algorithm::PushTwoStage,
        ),
        CallDesc::plain(
            4 * 7168,
            p2p_allreduce::Dtype::Bf16,
            Algorithm::PushTwoStage,
        ),
    );
}
