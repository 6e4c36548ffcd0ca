//! The flag protocol of every barrier, written once and generic over the
//! atomic word and the clock, so the kernels use it with core atomics and
//! `%globaltimer`, and the loom model runs the same code with loom atomics.
//!
//! Protocol for barrier kind K, block b, between rank r and peer p:
//! 1. `arrive_ordered`: r stores the collective's epoch into p's signal at
//!    `K[b][r]`, with release semantics where the barrier publishes data
//!    ([`Order::Publish`]) and relaxed otherwise ([`Order::ArrivalOnly`]);
//! 2. `wait_ordered`: r polls its own signal at `K[b][p]` with relaxed loads
//!    until it holds the epoch (then, for `Publish`, reads it once more with
//!    acquire), or until the timeout passes.
//! Only plain stores and loads touch peer memory: PCIe peer-to-peer has no
//! read-modify-write atomics. Which barrier uses which order, and the
//! hardware and stream-order facts the relaxed ones rely on, are in
//! docs/design.md; tests/loom_barrier.rs models both.
//!
//! Why equality is enough: a peer writes the next epoch into a slot of set
//! K only after passing the next `Start` barrier (or, for `Start` itself,
//! after finishing this collective's last barrier), and both need this
//! rank's arrival there, which comes after this rank's wait on the slot.
//! So a slot never moves past the value being waited for.

/// A 32-bit flag in memory another rank can see.
pub trait FlagWord {
    fn load_acquire(&self) -> u32;
    fn store_release(&self, value: u32);
    fn load_relaxed(&self) -> u32;
    fn store_relaxed(&self, value: u32);
}

impl FlagWord for core::sync::atomic::AtomicU32 {
    #[inline(always)]
    fn load_acquire(&self) -> u32 {
        // Lowers to ld.acquire.sys on sm_70+.
        self.load(core::sync::atomic::Ordering::Acquire)
    }
    #[inline(always)]
    fn store_release(&self, value: u32) {
        // Lowers to st.release.sys on sm_70+.
        self.store(value, core::sync::atomic::Ordering::Release)
    }
    #[inline(always)]
    fn load_relaxed(&self) -> u32 {
        // ld.relaxed.sys: never served from a stale L1 line.
        self.load(core::sync::atomic::Ordering::Relaxed)
    }
    #[inline(always)]
    fn store_relaxed(&self, value: u32) {
        self.store(value, core::sync::atomic::Ordering::Relaxed)
    }
}

/// How much a barrier must order.
///
/// `Publish` (release/acquire) is needed where a peer reads data written
/// earlier in the same kernel: the two-stage partial sums before `Mid`.
/// `ArrivalOnly` (relaxed) is enough for `Start` and `End`: inputs were
/// written by earlier work on the owner's stream, which completed before
/// the owner's kernel began, and every peer read that `End` protects has
/// returned its value (it fed a store) before the reader's bar.sync and
/// arrival. Relaxed polls are cheaper than system-scope acquires in the
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

/// The epoch that follows `prev`. Zero is never used, so zeroed signal
/// memory never looks like an arrival.
#[inline(always)]
pub const fn next_epoch(prev: u32) -> u32 {
    let e = prev.wrapping_add(1);
    if e == 0 {
        1
    } else {
        e
    }
}

/// Step 1: tell the peer we arrived (release: publishes earlier writes).
#[inline(always)]
pub fn arrive<F: FlagWord + ?Sized>(slot_in_peer: &F, epoch: u32) {
    arrive_ordered(slot_in_peer, epoch, Order::Publish);
}

/// [`arrive`] with an explicit [`Order`].
#[inline(always)]
pub fn arrive_ordered<F: FlagWord + ?Sized>(slot_in_peer: &F, epoch: u32, order: Order) {
    match order {
        Order::Publish => slot_in_peer.store_release(epoch),
        Order::ArrivalOnly => slot_in_peer.store_relaxed(epoch),
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Wait {
    Arrived,
    TimedOut,
}

/// Step 2: wait for the peer's arrival (acquire). `timeout_ns == 0` waits forever.
#[inline(always)]
pub fn wait<F: FlagWord + ?Sized, C: Clock>(
    own_slot: &F,
    epoch: u32,
    timeout_ns: u64,
    clock: &mut C,
) -> Wait {
    wait_ordered(own_slot, epoch, timeout_ns, clock, Order::Publish)
}

/// [`wait`] with an explicit [`Order`].
#[inline(always)]
pub fn wait_ordered<F: FlagWord + ?Sized, C: Clock>(
    own_slot: &F,
    epoch: u32,
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
    if own_slot.load_relaxed() == epoch {
        return arrived(own_slot);
    }
    let t0 = if timeout_ns != 0 { clock.now_ns() } else { 0 };
    let mut polls: u32 = 0;
    loop {
        if own_slot.load_relaxed() == epoch {
            return arrived(own_slot);
        }
        clock.relax();
        polls = polls.wrapping_add(1);
        if timeout_ns != 0 && polls % POLLS_PER_CLOCK_READ == 0 {
            let now = clock.now_ns();
            if now.wrapping_sub(t0) > timeout_ns {
                // One last look, so an arrival racing with the deadline wins.
                return if own_slot.load_relaxed() == epoch {
                    arrived(own_slot)
                } else {
                    Wait::TimedOut
                };
            }
        }
    }
}
