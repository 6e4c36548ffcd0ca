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
//!
//! # Layout
//!
//! One test target, `loom_barrier`: this file holds the shared harness's
//! runners (a world of ranks, the search bounds, the expected failures);
//! [`model`] the memory, flags and the [`Protocol`] to model, [`rank`] one
//! rank's stream operations; the tests are by protocol family: [`pull`]
//! (one-stage and two-stage, and their must-fail variants), [`faults`]
//! (timeouts), [`push`], [`push_ll`], [`push_two_stage`] (with push_islands),
//! [`mismatches`] (ranks whose calls differ).

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

mod faults;
mod mismatches;
mod model;
mod pull;
mod push;
mod push_ll;
mod push_two_stage;
mod rank;

use model::*;
use rank::*;

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
