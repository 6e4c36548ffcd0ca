//! The flag protocol of every barrier, written once and generic over the
//! atomic word and the clock, so the kernels use it with core atomics and
//! `%globaltimer`, and the loom model runs the same code with loom atomics.
//!
//! Which barriers each algorithm runs ([`barriers`]) and with which memory
//! order ([`order`]) is decided here too, once: the kernels and the loom
//! model (tests/loom_barrier/) both read that table.
//!
//! Protocol for barrier kind K, block b, between rank r and peer p:
//! 1. [`arrive_ordered`]: r stores the collective's epoch into p's signal at
//!    `K[b][r]`, with release semantics where the barrier publishes data
//!    ([`Order::Publish`]) and relaxed otherwise ([`Order::ArrivalOnly`]);
//! 2. [`wait_ordered`]: r polls its own signal at `K[b][p]` with relaxed
//!    loads until it holds the epoch (then, for `Publish`, reads it once
//!    more with acquire), or until the timeout passes.
//!
//! Only plain stores and loads touch peer memory: PCIe peer-to-peer has no
//! read-modify-write atomics. The hardware and stream-order facts the
//! relaxed barriers rely on are in docs/design/algorithms.md ("Barriers");
//! tests/loom_barrier/ models them.
//!
//! Waits accept the awaited epoch or the next one ([`reached`]). For the
//! pull algorithms only the awaited one comes: a peer writes the next
//! epoch into a slot of set K only after passing the next `Start` barrier (or, for
//! `Start` itself, after finishing this collective's last barrier), and both
//! need this rank's arrival there, which comes after this rank's wait on the
//! slot, so a slot never moves past the value being waited for. Push has
//! only `Start`: a peer can finish a collective without waiting for this
//! rank's reads and arrive at the next one, one epoch ahead (never two: its
//! next wait needs this rank's next arrival).
//!
//! The kernels keep one flag per barrier *and epoch parity*
//! (`Signal::flag_offset`), so a peer one collective ahead writes the other
//! parity's flag and a wait sees only its own collective's word; and the
//! word is the epoch with the writer's 32-bit call tag in its high half
//! (`abi::flag_word`), so a wait never takes a word of another call for an
//! arrival. `reached` still accepts the next epoch: the protocol is sound
//! with one flag per barrier too, which is what `tests/loom_barrier/`
//! models.

use crate::abi::{Algorithm, BarrierKind};

/// The memory order of barrier `kind` in algorithm `algo`.
///
/// - `Start` of [`Algorithm::Push`] and [`Algorithm::PushTwoStage`] must be
///   [`Order::Publish`]: each rank wrote its input into the peers' landing
///   zones in the same kernel just before arriving, and the peers read them
///   right after their wait.
/// - `Start` (pull algorithms) is [`Order::ArrivalOnly`]: what peers read after it (the
///   inputs) was written by earlier work on the owner's stream, which had
///   completed, all its writes performed, before the owner's kernel began
///   and so before its arrival; and no access after a poll that saw the
///   epoch (and the `bar.sync` after it) is performed before that poll.
///   Ordering comes from stream order, not from the flag.
/// - `End` is [`Order::ArrivalOnly`]: every peer read it protects has
///   returned its value (the value fed a store) before the reader's
///   `bar.sync` and arrival, and the owner overwrites its input only in
///   later stream work, after its kernel (and so its wait) completed.
/// - `Mid` must be [`Order::Publish`]: peers read the partial sums written
///   earlier in the same kernel (two-stage: in the owner's scratch;
///   push_two_stage: written by the owner into the reader's landing zone),
///   with no stream boundary in between, so only release/acquire on the
///   flag orders those writes before the reads.
/// - Every barrier of [`Algorithm::PushIslands`] is [`Order::Publish`]:
///   each follows writes into peers' landing zones that they read next.
#[inline(always)]
pub const fn order(algo: Algorithm, kind: BarrierKind) -> Order {
    match (algo, kind) {
        (Algorithm::Push | Algorithm::PushTwoStage, BarrierKind::Start) => Order::Publish,
        // Every barrier of push_islands follows writes into peers' zones
        // that the peers read right after it.
        (Algorithm::PushIslands, _) => Order::Publish,
        (_, BarrierKind::Start | BarrierKind::End) => Order::ArrivalOnly,
        (_, BarrierKind::Mid | BarrierKind::Back | BarrierKind::Relay) => Order::Publish,
    }
}

/// The barriers a kernel of `algo` runs, in program order.
///
/// - One-stage: `Start` (before any read of a peer's input), `End` (no rank
///   returns, letting its input be overwritten, while a peer still reads it).
/// - Two-stage: `Start`, `Mid` (between reduce-scatter into scratch and
///   all-gather from peers' scratch), and no `End`: peers read inputs only
///   before `Mid`, and a rank's scratch is next written after the next
///   collective's `Start`, which a peer reaches only once its whole kernel
///   for this collective (every stage-2 read of scratch) has completed,
///   because kernels on one stream run in order.
///
/// - Push: `Start` only. Each rank writes its input into a per-source slot
///   of every peer's landing zone, arrives (publishing), waits for every
///   peer, and reduces its own landing zone locally: no rank reads peer
///   memory, so nothing needs an `End`. Landing zones alternate between two
///   slots by epoch parity: a rank writes slot `e % 2` again at collective
///   `e + 2`, which it starts only after its `e + 1` wait saw every peer's
///   `e + 1` arrival, made in kernels that began after the peers' kernels
///   for `e` (every read of slot `e % 2`) had completed. A peer can
///   therefore be one collective ahead, so waits accept the awaited epoch
///   or the next one ([`reached`]). Every collective advances every
///   block's epoch counter (also those its grid does not run), so all
///   blocks of a collective agree on the parity. The slots' layout is fixed for the
///   group (`LaunchArgs::landing_part` bytes per source), whatever the
///   message size: with a layout sized by the message, a peer one
///   collective ahead would write a larger or smaller slot 1 that overlaps
///   the slot 0 still being read (seen on the GPUs as a wrong element).
///
/// - PushTwoStage: `Start` (publishes each rank's partitions written into
///   their owners' landing zones) and `Mid` (publishes each owner's reduced
///   partition written into every peer's zone); no `End`, as for push: no
///   rank reads peer memory. A part of a zone holds the source's share of
///   the owner's partition and the source's own reduced partition in
///   separate regions ([`crate::abi::PushTwoStagePart`]), and one slot
///   serves every collective: a source writes the scatter region of the
///   next collective only after passing this collective's `Mid`, which
///   needs the owner's `Mid` arrival, made after the owner's last read of
///   that region (stage 2); it writes the gather region of the next
///   collective only after the next `Start`, which needs the owner's
///   arrival there, made after the owner's whole kernel for this
///   collective (every read of the gather region) completed. A peer
///   reaches `Mid` of the next collective only after that collective's
///   `Start`, which needs this rank's arrival, so no slot is ever ahead of
///   the awaited epoch by more than one.
///
/// - PushIslands (ranks `0..h` form island A, `h..N` island B,
///   `h = island_split(N)`; island index `i` = rank - first rank of the
///   island; partition `i < h` is owned by A's rank `i` and B's rank
///   `h + i`, counterparts): `Start` (publishes the partitions each rank
///   wrote into its island owners' zones, and every rank's tail written
///   into every zone), `Mid` (publishes A's unrounded f32 partials written
///   into the counterparts' zones), `Back` (publishes B's reduced
///   partitions written into the counterparts' zones and into B's other
///   ranks' zones) and `Relay`, among A's ranks only (publishes the
///   reduced partitions A's ranks relayed within A). `Start`, `Mid` and
///   `Back` are between all ranks. One slot serves every collective: a
///   scatter region and a tail pack are written again at the next
///   collective's first step, by a rank that passed this collective's
///   `Back`, which needs the reader's `Back` arrival, made after its last
///   read of them (before its `Mid` arrival for A, its `Back` arrival for
///   B); the cross and gather regions are written again only after the
///   next collective's `Start`, which needs the reader's arrival there,
///   made after its whole kernel completed. B's ranks finish at `Back`, so
///   they can run the next collective's first step while A's ranks still
///   wait at `Relay`: that step writes only B's scatter regions and the
///   tail packs, both already free. No flag runs more than one collective
///   ahead: every barrier of the next collective follows its `Start`, which
///   needs this rank's arrival.
///
/// - PushLl: none. Its arrival signal is the data itself (flag-in-data
///   lines, [`crate::ll`], which says why two slots and equality on the
///   epoch suffice); each block commits the epoch after a `bar.sync` that
///   follows every thread's read of the old one.
///
/// Invariants, checked at compile time below: every non-empty sequence
/// begins with `Start` (the kernels commit the new epoch after it), and
/// kinds appear at
/// most once, in the order `Start`, `Mid`, `End`, `Back`, `Relay`, which
/// is the order of the barrier sites in the kernels and in the model.
#[inline(always)]
pub const fn barriers(algo: Algorithm) -> &'static [BarrierKind] {
    match algo {
        Algorithm::OneStage => &[BarrierKind::Start, BarrierKind::End],
        Algorithm::TwoStage => &[BarrierKind::Start, BarrierKind::Mid],
        Algorithm::Push => &[BarrierKind::Start],
        Algorithm::PushLl => &[],
        Algorithm::PushTwoStage => &[BarrierKind::Start, BarrierKind::Mid],
        Algorithm::PushIslands => &[
            BarrierKind::Start,
            BarrierKind::Mid,
            BarrierKind::Back,
            BarrierKind::Relay,
        ],
    }
}

/// The barriers rank `rank` of a `world`-rank group runs in push_islands,
/// in order: a subsequence of [`barriers`]`(PushIslands)`. One rank alone
/// runs `Start` only (it reduces everything itself); `Relay` runs among
/// island A's ranks only, and only when island A has more than one.
#[inline(always)]
pub const fn islands_barriers(world: usize, rank: usize) -> &'static [BarrierKind] {
    let h = crate::abi::island_split(world);
    if world <= 1 {
        &[BarrierKind::Start]
    } else if rank < h && h > 1 {
        &[
            BarrierKind::Start,
            BarrierKind::Mid,
            BarrierKind::Back,
            BarrierKind::Relay,
        ]
    } else {
        &[BarrierKind::Start, BarrierKind::Mid, BarrierKind::Back]
    }
}

/// Whether a kernel of `algo` runs barrier `kind` (see [`barriers`]).
#[inline(always)]
pub const fn runs(algo: Algorithm, kind: BarrierKind) -> bool {
    // A lookup in a table computed at compile time, rather than a search of
    // the sequence, so the kernels' test folds as early as a constant does.
    RUNS[algo as usize][kind as usize]
}

/// Indices of `RUNS`' rows: the largest [`BarrierKind`] value, plus one.
const KINDS: usize = BarrierKind::Relay as usize + 1;

/// `RUNS[algo][kind]`: whether `kind` is in `barriers(algo)`.
const RUNS: [[bool; KINDS]; Algorithm::ALL.len()] = {
    let mut t = [[false; KINDS]; Algorithm::ALL.len()];
    let mut a = 0;
    while a < Algorithm::ALL.len() {
        let algo = Algorithm::ALL[a];
        let seq = barriers(algo);
        let mut i = 0;
        while i < seq.len() {
            t[algo as usize][seq[i] as usize] = true;
            i += 1;
        }
        a += 1;
    }
    t
};

// The table's invariants (see `barriers`).
const _: () = {
    let mut a = 0;
    while a < Algorithm::ALL.len() {
        let seq = barriers(Algorithm::ALL[a]);
        assert!(seq.is_empty() || seq[0] as u32 == BarrierKind::Start as u32);
        let mut i = 1;
        while i < seq.len() {
            assert!((seq[i - 1] as u32) < seq[i] as u32);
            i += 1;
        }
        a += 1;
    }
    assert!(matches!(
        order(Algorithm::TwoStage, BarrierKind::Mid),
        Order::Publish
    ));
    assert!(matches!(
        order(Algorithm::Push, BarrierKind::Start),
        Order::Publish
    ));
    assert!(matches!(
        order(Algorithm::PushTwoStage, BarrierKind::Start),
        Order::Publish
    ));
    assert!(matches!(
        order(Algorithm::PushTwoStage, BarrierKind::Mid),
        Order::Publish
    ));
    let seq = barriers(Algorithm::PushIslands);
    let mut i = 0;
    while i < seq.len() {
        assert!(matches!(
            order(Algorithm::PushIslands, seq[i]),
            Order::Publish
        ));
        i += 1;
    }
};

/// A 64-bit flag in memory another rank can see: the epoch in the low
/// half, the writer's call tag in the high half (`abi::flag_word`). An
/// aligned 8-byte access is single-copy atomic, so a load sees one
/// store's epoch and tag together.
pub trait FlagWord {
    fn load_acquire(&self) -> u64;
    fn store_release(&self, value: u64);
    fn load_relaxed(&self) -> u64;
    fn store_relaxed(&self, value: u64);
}

impl FlagWord for core::sync::atomic::AtomicU64 {
    #[inline(always)]
    fn load_acquire(&self) -> u64 {
        // Lowers to ld.acquire.sys on sm_70+.
        self.load(core::sync::atomic::Ordering::Acquire)
    }
    #[inline(always)]
    fn store_release(&self, value: u64) {
        // Lowers to st.release.sys on sm_70+.
        self.store(value, core::sync::atomic::Ordering::Release)
    }
    #[inline(always)]
    fn load_relaxed(&self) -> u64 {
        // ld.relaxed.sys: never served from a stale L1 line.
        self.load(core::sync::atomic::Ordering::Relaxed)
    }
    #[inline(always)]
    fn store_relaxed(&self, value: u64) {
        self.store(value, core::sync::atomic::Ordering::Relaxed)
    }
}

/// How much a barrier must order. Which barrier uses which, and why, is
/// [`order`].
///
/// `Publish` is release/acquire on the flag; `ArrivalOnly` is relaxed, and
/// relaxed polls are cheaper than system-scope acquires in the
/// latency-bound small-message regime.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Order {
    Publish,
    ArrivalOnly,
}

/// Time source for bounded waits.
pub trait Clock {
    /// Nanoseconds from an arbitrary origin, non-decreasing.
    fn now_ns(&mut self) -> u64;
    /// Called once per unsuccessful poll (a yield under loom, a no-op or a
    /// short sleep on the GPU).
    #[inline(always)]
    fn relax(&mut self) {}
}

/// Polls between two clock reads: reading `%globaltimer` every iteration
/// would slow the fast path of the loop for no gain.
pub const POLLS_PER_CLOCK_READ: u32 = 32;
const _: () = assert!(POLLS_PER_CLOCK_READ.is_power_of_two());

/// Whether a flag holding `value` shows an arrival at the flag word
/// `awaited` (`abi::flag_word`: the epoch in the low half, the call tag in
/// the high half): the awaited word itself, or the word of the next epoch
/// under the same tag. A peer is never more than one
/// collective ahead (see [`barriers`]), so nothing else is an arrival; zero
/// (never written) has not reached anything. For the pull algorithms a
/// slot never moves past the awaited epoch, so only the first holds there.
///
/// Equality, not an ordered (wrapping) comparison: a flag is written only
/// by the collectives whose algorithm runs that barrier in that block, but
/// every collective advances every block's epoch, so a flag can sit
/// untouched while any number of other collectives (push_ll, or launches
/// of fewer blocks) pass. An ordered comparison took a flag last written
/// 2^31 or more collectives ago for an arrival (its wrapping difference
/// turns positive), and then a wait passed without its peer. With
/// equality a stale flag passes only if it was written exactly a multiple
/// of the epoch period (2^32 - 2 collectives) before, or one less: the
/// same bound as the LL words' (crate::ll). A word of another call
/// (another tag in the high half) never passes, however old.
#[inline(always)]
pub const fn reached(value: u64, awaited: u64) -> bool {
    value == awaited || value == next_word(awaited)
}

/// The flag word of the epoch after `w`'s, under `w`'s tag.
#[inline(always)]
pub const fn next_word(w: u64) -> u64 {
    (w & !0xffff_ffff) | next_epoch(w as u32) as u64
}

/// The epoch that follows `prev`. Zero is never used, so zeroed signal
/// memory never looks like an arrival; at the wrap `u32::MAX` is followed
/// by 2, not 1, so consecutive epochs always alternate in parity (push
/// picks its landing slot by parity, see [`barriers`]).
#[inline(always)]
pub const fn next_epoch(prev: u32) -> u32 {
    let e = prev.wrapping_add(1);
    if e == 0 {
        2
    } else {
        e
    }
}

/// Step 1: tell the peer we arrived, with the given [`Order`] (release
/// for [`Order::Publish`]: publishes this thread's earlier writes).
#[inline(always)]
pub fn arrive_ordered<F: FlagWord + ?Sized>(slot_in_peer: &F, word: u64, order: Order) {
    match order {
        Order::Publish => slot_in_peer.store_release(word),
        Order::ArrivalOnly => slot_in_peer.store_relaxed(word),
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Wait {
    Arrived,
    TimedOut,
}

/// Step 2: wait for the peer's arrival at flag word `word` ([`reached`];
/// for [`Order::Publish`], with an acquire that synchronizes with its
/// release). `timeout_ns == 0` waits forever.
#[inline(always)]
pub fn wait_ordered<F: FlagWord + ?Sized, C: Clock>(
    own_slot: &F,
    word: u64,
    timeout_ns: u64,
    clock: &mut C,
    order: Order,
) -> Wait {
    // Polls are relaxed; with `Publish` the value seen is then read once more
    // with acquire, which synchronizes with the peer's release (the slot
    // cannot move on before this rank arrives at its next barrier).
    let arrived = |f: &F| -> Wait {
        if order == Order::Publish {
            let _ = f.load_acquire();
        }
        Wait::Arrived
    };
    if reached(own_slot.load_relaxed(), word) {
        return arrived(own_slot);
    }
    let t0 = if timeout_ns != 0 { clock.now_ns() } else { 0 };
    let mut polls: u32 = 0;
    loop {
        if reached(own_slot.load_relaxed(), word) {
            return arrived(own_slot);
        }
        clock.relax();
        polls = polls.wrapping_add(1);
        // `polls % POLLS_PER_CLOCK_READ == 0`, as a mask (a power of two).
        if timeout_ns != 0 && polls & (POLLS_PER_CLOCK_READ - 1) == 0 {
            let now = clock.now_ns();
            if now.wrapping_sub(t0) > timeout_ns {
                // One last look, so an arrival racing with the deadline wins.
                return if reached(own_slot.load_relaxed(), word) {
                    arrived(own_slot)
                } else {
                    Wait::TimedOut
                };
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reached_is_the_awaited_epoch_or_the_next_one() {
        for e in [
            1u32,
            2,
            3,
            1000,
            0x7fff_ffff,
            0x8000_0000,
            u32::MAX - 1,
            u32::MAX,
        ] {
            let tag = 0x5a5a_0001u64 << 32;
            let w = |e: u32| tag | e as u64;
            assert!(reached(w(e), w(e)));
            assert!(reached(w(next_epoch(e)), w(e)));
            assert!(!reached(0, w(e)), "never written");
            assert!(
                !reached(w(next_epoch(next_epoch(e))), w(e)),
                "two ahead never happens"
            );
            // Another call's word, at this epoch or the next: never.
            for other in [0u64, 1 << 32, tag ^ 1 << 63] {
                assert!(!reached(other | e as u64, w(e)));
                assert!(!reached(other | next_epoch(e) as u64, w(e)));
            }
            // A flag left by an earlier collective, however long ago: the
            // ordered comparison this replaced took ages of 2^31 and more
            // for arrivals.
            for age in [
                1u32,
                2,
                3,
                1 << 24,
                (1 << 31) - 1,
                1 << 31,
                (1 << 31) + 10,
                u32::MAX - 3,
            ] {
                let stale = e.wrapping_sub(age);
                if stale != 0 {
                    assert!(
                        !reached(w(stale), w(e)),
                        "epoch {e:#x}: a flag {age:#x} old"
                    );
                }
            }
        }
        // Across the wrap: u32::MAX is followed by 2.
        assert!(reached(2, u32::MAX as u64));
        assert!(!reached(1, u32::MAX as u64));
        assert_eq!(next_word(7 << 32 | u32::MAX as u64), 7 << 32 | 2);
    }
}
