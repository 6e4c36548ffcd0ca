//! The memory the ranks share (flags, buffers, landing zones, error
//! records), the hardware assumptions and the protocol to model.

use super::*;

/// A flag word in loom's memory model: the epoch in the low half, the
/// writer's call tag in the high half (`abi::flag_word`).
pub(crate) struct Flag(pub(crate) AtomicU64);

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
pub(crate) struct StepClock {
    pub(crate) now: u64,
}

pub(crate) const NS_PER_CLOCK_READ: u64 = 1_000;

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
pub(crate) struct LlPack {
    pub(crate) words: [AtomicU64; 4],
    pub(crate) flag: AtomicU32,
}

/// Where a push_ll pack keeps its epoch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum LlLayout {
    /// The kernels': in every word, next to the data it vouches for.
    InEveryWord,
    /// A must-fail variant: plain data words, then one flag word stored
    /// after them (relaxed, as no fence is used), read before them.
    FlagAfterData,
}

/// A pack as the shared protocol code sees it.
pub(crate) struct LlView<'a> {
    pub(crate) pack: &'a LlPack,
    pub(crate) layout: LlLayout,
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
pub(crate) const LL_LANES: usize = 4;

/// The error record a rank claims in its own signal, as the kernels do:
/// a compare-and-swap on the code claims it, then the fields are written.
pub(crate) struct ErrorSlot {
    pub(crate) code: AtomicU32,
    pub(crate) record: UnsafeCell<ErrorRecord>,
}

/// One rank's memory that peers can reach: a signal (one flag slot per
/// peer for each barrier kind), its input, its scratch, and (push) the
/// landing zone after the signal.
pub(crate) struct RankMem {
    pub(crate) world: usize,
    pub(crate) len: usize,
    pub(crate) start: Vec<Flag>,
    pub(crate) mid: Vec<Flag>,
    pub(crate) end: Vec<Flag>,
    pub(crate) back: Vec<Flag>,
    pub(crate) relay: Vec<Flag>,
    pub(crate) error: ErrorSlot,
    pub(crate) input: Vec<UnsafeCell<u32>>,
    pub(crate) scratch: Vec<UnsafeCell<u32>>,
    /// `[slot 0..2][source 0..world][element 0..len]`, as in the kernels
    /// (`abi::Signal::LANDING_OFFSET`), element-wise instead of in packs.
    pub(crate) landing: Vec<UnsafeCell<u32>>,
    /// push_ll: `[slot 0..2][source 0..world][pack]`, packs of
    /// [`LL_LANES`] elements (the kernels' `ll::slot` layout).
    pub(crate) ll: Vec<LlPack>,
}

impl RankMem {
    pub(crate) fn new(world: usize, len: usize) -> Self {
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
    pub(crate) fn ll_pack(&self, epoch: u32, slots: u32, src: usize, i: usize) -> &LlPack {
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
    pub(crate) fn landing(&self, slot: usize, src: usize, i: usize) -> &UnsafeCell<u32> {
        &self.landing[(slot * self.world + src) * self.len + i]
    }
    /// The slot that peer `from` writes in this signal.
    pub(crate) fn slot(&self, kind: BarrierKind, from: usize) -> &Flag {
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
pub(crate) struct Hw {
    pub(crate) stream_order: bool,
    pub(crate) polls_gate_accesses: bool,
    pub(crate) reads_done_before_end: bool,
}

impl Hw {
    pub(crate) const ALL: Hw = Hw {
        stream_order: true,
        polls_gate_accesses: true,
        reads_done_before_end: true,
    };
    /// Only what the C++ memory model gives.
    pub(crate) const NONE: Hw = Hw {
        stream_order: false,
        polls_gate_accesses: false,
        reads_done_before_end: false,
    };
}

/// What to model.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Protocol {
    pub(crate) world: usize,
    /// Elements per message (two-stage: split into `world` partitions).
    pub(crate) len: usize,
    pub(crate) collectives: u32,
    pub(crate) algo: Algorithm,
    /// `None` removes the barrier (each of the three).
    pub(crate) start: Option<Order>,
    /// Two-stage only: one-stage has no place for it.
    pub(crate) mid: Option<Order>,
    /// `None`: no end barrier.
    pub(crate) end: Option<Order>,
    /// push_islands only (`None` removes them).
    pub(crate) back: Option<Order>,
    pub(crate) relay: Option<Order>,
    pub(crate) hw: Hw,
    /// 0 waits forever, as in the kernels.
    pub(crate) timeout_ns: u64,
    /// The epoch counter's value before the first collective (0 in zeroed
    /// memory).
    pub(crate) epoch_before: u32,
    /// A rank that dies (leaves without a word, as `absent_ranks` makes a
    /// kernel do) just before it would arrive at the given barrier of the
    /// given collective.
    pub(crate) dies: Option<(usize, u32, BarrierKind)>,
    /// A rank that is late: it yields this many times before its first
    /// input copy. Under loom a yield hands the processor to the other
    /// ranks, so this is how a slow peer is modelled.
    pub(crate) late: Option<(usize, u32)>,
    /// Push only: landing-zone slots a rank cycles through, by epoch
    /// (`epoch % landing_slots`). The kernels use two (`epoch & 1`); one is
    /// a must-fail variant.
    pub(crate) landing_slots: u32,
    /// How a wait decides that a peer arrived.
    pub(crate) wait: WaitRule,
    /// push_ll only: where a pack keeps its epoch.
    pub(crate) ll_layout: LlLayout,
    /// push_ll only, a must-fail variant: every collective's packs carry
    /// this epoch instead of their own.
    pub(crate) ll_fixed_epoch: Option<u32>,
    /// The call tag each rank's words carry (`abi::flag_word`,
    /// `abi::ll_highs`); all equal unless ranks disagree about the call.
    pub(crate) tags: [u32; 4],
    /// A rank whose call has fewer elements than `len` (ranks that
    /// disagree about the count): `(rank, its len)`.
    pub(crate) short: Option<(usize, usize)>,
}

/// The arrival test of a wait.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum WaitRule {
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
pub(crate) struct Exactly<'a> {
    pub(crate) flag: &'a Flag,
    pub(crate) word: u64,
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
pub(crate) const fn table_order(algo: Algorithm, kind: BarrierKind) -> Option<Order> {
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
    pub(crate) const fn kernels(
        world: usize,
        len: usize,
        collectives: u32,
        algo: Algorithm,
    ) -> Self {
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
    pub(crate) const fn release_acquire(
        world: usize,
        len: usize,
        collectives: u32,
        algo: Algorithm,
    ) -> Self {
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

    pub(crate) fn order(&self, kind: BarrierKind) -> Option<Order> {
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
pub(crate) enum Outcome {
    /// Every collective completed; the last one's result.
    Done(Vec<u32>),
    /// A barrier timed out: the record the rank left in its signal.
    Failed(ErrorRecord),
    /// The rank was told to die.
    Died,
}

/// Input of `rank` at element `i` in collective `c`: distinct for every
/// (collective, rank, element), so a stale or early read is visible.
pub(crate) fn input_value(c: u32, rank: usize, i: usize) -> u32 {
    1 + c * 10_000 + rank as u32 * 100 + i as u32
}

pub(crate) fn expected_sum(c: u32, world: usize, i: usize) -> u32 {
    (0..world).fold(0u32, |acc, r| acc.wrapping_add(input_value(c, r, i)))
}

pub(crate) fn record_error(
    mem: &RankMem,
    rank: usize,
    peer: usize,
    epoch: u32,
    kind: BarrierKind,
    tag: u32,
) {
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
