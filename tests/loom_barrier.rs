//! A loom model of the kernels' barrier protocol, run with the very code the
//! kernels use (`device::barrier::{arrive, wait, next_epoch}`), on loom
//! atomics instead of GPU memory.
//!
//! Each rank is one loom thread. That folds a block's "thread p exchanges
//! flags with peer p" into one thread that first arrives at every peer and
//! then waits for every peer, which is what the `bar.sync` around the
//! exchange makes of it: no rank's arrival ever waits on a wait. The model
//! has one block (flags of other blocks are separate words, so blocks do not
//! interact through the protocol).
//!
//! Buffers (input, scratch) are `loom::cell::UnsafeCell`s, so loom itself
//! reports any read that is not ordered after the write it should see, or a
//! write that races with a peer's read; on top of that every value read is
//! checked to belong to the right collective.

use loom::cell::UnsafeCell;
use loom::model::Builder;
use loom::sync::atomic::{AtomicU32, Ordering};
use loom::sync::Arc;
use p2p_allreduce::abi::{error_code, BarrierKind, ErrorRecord};
use p2p_allreduce::device::barrier::{arrive, next_epoch, wait, Clock, FlagWord, Wait};
use p2p_allreduce::device::reduce::partition;

/// A flag word in loom's memory model, with the orderings the kernels use.
struct Flag(AtomicU32);

impl FlagWord for Flag {
    fn load_acquire(&self) -> u32 {
        self.0.load(Ordering::Acquire)
    }
    fn store_release(&self, value: u32) {
        self.0.store(value, Ordering::Release)
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

/// The error record a rank claims in its own signal, as the kernels do:
/// a compare-and-swap on the code claims it, then the fields are written.
struct ErrorSlot {
    code: AtomicU32,
    record: UnsafeCell<ErrorRecord>,
}

/// One rank's memory that peers can reach: a signal (one flag slot per
/// peer for each barrier kind), its input and its scratch.
struct RankMem {
    start: Vec<Flag>,
    mid: Vec<Flag>,
    end: Vec<Flag>,
    error: ErrorSlot,
    input: Vec<UnsafeCell<u32>>,
    scratch: Vec<UnsafeCell<u32>>,
}

impl RankMem {
    fn new(world: usize, len: usize) -> Self {
        let flags = || (0..world).map(|_| Flag(AtomicU32::new(0))).collect();
        let cells = || (0..len).map(|_| UnsafeCell::new(0)).collect();
        RankMem {
            start: flags(),
            mid: flags(),
            end: flags(),
            error: ErrorSlot {
                code: AtomicU32::new(error_code::NONE),
                record: UnsafeCell::new(ErrorRecord::default()),
            },
            input: cells(),
            scratch: cells(),
        }
    }
    /// The slot that peer `from` writes in this signal.
    fn slot(&self, kind: BarrierKind, from: usize) -> &Flag {
        match kind {
            BarrierKind::Start => &self.start[from],
            BarrierKind::Mid => &self.mid[from],
            BarrierKind::End => &self.end[from],
        }
    }
}

/// What to model.
#[derive(Clone, Copy, Debug)]
struct Protocol {
    world: usize,
    /// Elements per message (two-stage: split into `world` partitions).
    len: usize,
    collectives: u32,
    two_stage: bool,
    /// Off only to prove the model catches the missing barrier.
    end_barrier: bool,
    mid_barrier: bool,
    /// 0 waits forever, as in the kernels.
    timeout_ns: u64,
    /// The epoch counter's value before the first collective (0 in zeroed
    /// memory).
    epoch_before: u32,
    /// A rank that dies (leaves without a word) just before it would
    /// arrive at the given barrier of the given collective.
    dies: Option<(usize, u32, BarrierKind)>,
}

impl Protocol {
    const fn new(world: usize, len: usize, collectives: u32, two_stage: bool) -> Self {
        Protocol {
            world,
            len,
            collectives,
            two_stage,
            end_barrier: true,
            mid_barrier: true,
            timeout_ns: 0,
            epoch_before: 0,
            dies: None,
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

fn record_error(mem: &RankMem, rank: usize, peer: usize, epoch: u32, kind: BarrierKind) {
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
                    _reserved: [0; 2],
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
}

enum Stop {
    Died,
    TimedOut,
}

impl Rank<'_> {
    fn barrier(&mut self, c: u32, kind: BarrierKind, epoch: u32) -> Result<(), Stop> {
        if self.p.dies == Some((self.me, c, kind)) {
            return Err(Stop::Died);
        }
        for peer in self.world {
            arrive(peer.slot(kind, self.me), epoch);
        }
        let own = &self.world[self.me];
        let mut failed = false;
        for peer in 0..self.p.world {
            // Every peer is waited for, even after a timeout, as the
            // kernel's threads wait side by side.
            if wait(
                own.slot(kind, peer),
                epoch,
                self.p.timeout_ns,
                &mut self.clock,
            ) == Wait::TimedOut
            {
                record_error(own, self.me, peer, epoch, kind);
                failed = true;
            }
        }
        if failed {
            Err(Stop::TimedOut)
        } else {
            Ok(())
        }
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
                "rank {} collective {c}: input {i} of rank {r} read before it was written \
                 for this collective (or after it was overwritten)",
                self.me
            );
            acc = acc.wrapping_add(v);
        }
        acc
    }

    fn run(mut self) -> Outcome {
        let (n, len) = (self.p.world, self.p.len);
        let mut epoch = self.p.epoch_before;
        let mut out = vec![0u32; len];
        for c in 0..self.p.collectives {
            epoch = next_epoch(epoch);
            assert_ne!(epoch, 0, "epoch 0 would match zeroed flags");
            for i in 0..len {
                Self::write(&self.world[self.me].input[i], input_value(c, self.me, i));
            }
            if let Err(stop) = self.barrier(c, BarrierKind::Start, epoch) {
                return self.stopped(stop);
            }
            if !self.p.two_stage {
                for (i, o) in out.iter_mut().enumerate() {
                    *o = self.reduce(c, i);
                }
            } else {
                let (s, e) = partition(len as u64, n as u32, self.me as u32);
                for i in s as usize..e as usize {
                    out[i] = self.reduce(c, i);
                    Self::write(&self.world[self.me].scratch[i], out[i]);
                }
                if self.p.mid_barrier {
                    if let Err(stop) = self.barrier(c, BarrierKind::Mid, epoch) {
                        return self.stopped(stop);
                    }
                }
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
            if self.p.end_barrier {
                if let Err(stop) = self.barrier(c, BarrierKind::End, epoch) {
                    return self.stopped(stop);
                }
            }
            for (i, &o) in out.iter().enumerate() {
                assert_eq!(
                    o,
                    expected_sum(c, n, i),
                    "rank {} collective {c} element {i}",
                    self.me
                );
            }
        }
        Outcome::Done(out)
    }

    fn stopped(&self, stop: Stop) -> Outcome {
        match stop {
            Stop::Died => Outcome::Died,
            Stop::TimedOut => {
                let own = &self.world[self.me];
                assert_eq!(
                    own.error.code.load(Ordering::Acquire),
                    error_code::PEER_TIMEOUT
                );
                // SAFETY: this rank's record is written only by this rank.
                Outcome::Failed(own.error.record.with(|r| unsafe { *r }))
            }
        }
    }
}

/// Runs every rank of `p` as a loom thread and returns their outcomes, in
/// rank order. Joining every thread is the no-deadlock check: loom fails
/// an execution in which some thread can never finish.
fn run_world(p: Protocol) -> Vec<Outcome> {
    let world: Arc<Vec<RankMem>> =
        Arc::new((0..p.world).map(|_| RankMem::new(p.world, p.len)).collect());
    let handles: Vec<_> = (0..p.world)
        .map(|me| {
            let world = world.clone();
            loom::thread::spawn(move || {
                Rank {
                    world: &world,
                    me,
                    p,
                    clock: StepClock { now: 0 },
                }
                .run()
            })
        })
        .collect();
    handles
        .into_iter()
        .map(|h| h.join().expect("rank thread panicked"))
        .collect()
}

fn builder(preemptions: usize) -> Builder {
    let mut b = Builder::new();
    b.preemption_bound = Some(preemptions);
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

#[test]
fn one_stage_two_ranks_two_collectives() {
    model_completes(Protocol::new(2, 2, 2, false), 3);
}

#[test]
fn one_stage_three_ranks_two_collectives() {
    model_completes(Protocol::new(3, 1, 2, false), 2);
}

#[test]
fn two_stage_two_ranks_two_collectives() {
    // Three elements: partitions of unequal size (2 and 1).
    model_completes(Protocol::new(2, 3, 2, true), 2);
}

#[test]
fn two_stage_three_ranks() {
    // Three ranks, two collectives and three barriers each is beyond a
    // reasonable exhaustive run; one collective with preemption bound 2
    // still checks the mid barrier's scratch visibility and the end barrier.
    model_completes(Protocol::new(3, 3, 1, true), 2);
}

/// Epochs wrap from u32::MAX to 1 (never 0, the value of zeroed flags),
/// and the protocol still matches arrivals across the wrap.
#[test]
fn epochs_wrap_past_zero() {
    assert_eq!(next_epoch(u32::MAX), 1);
    assert_eq!(next_epoch(0), 1);
    let p = Protocol {
        epoch_before: u32::MAX - 1,
        ..Protocol::new(2, 1, 3, false)
    };
    model_completes(p, 2);
}

/// Runs a model in which some rank dies; `check` sees the outcomes of
/// every execution loom explores.
fn model_with_death(p: Protocol, preemptions: usize, check: fn(&[Outcome])) {
    builder(preemptions).check(move || check(&run_world(p)));
}

fn timeout_record(peer: u32, epoch: u32, kind: BarrierKind) -> ErrorRecord {
    ErrorRecord {
        code: error_code::PEER_TIMEOUT,
        rank: 0,
        block: 0,
        peer,
        epoch,
        barrier: kind as u32,
        _reserved: [0; 2],
    }
}

/// Rank 1 never arrives: rank 0 must not hang, and leaves a record naming
/// peer 1, the first epoch and the start barrier.
#[test]
fn dead_peer_at_start_times_out_with_record() {
    let p = Protocol {
        timeout_ns: NS_PER_CLOCK_READ / 2,
        dies: Some((1, 0, BarrierKind::Start)),
        ..Protocol::new(2, 1, 1, false)
    };
    model_with_death(p, 2, |o| {
        assert_eq!(o[1], Outcome::Died);
        assert_eq!(
            o[0],
            Outcome::Failed(timeout_record(1, 1, BarrierKind::Start))
        );
    });
}

/// Rank 1 completes the first collective and dies before the end barrier
/// of the second: rank 0 reports epoch 2 at the end barrier.
#[test]
fn dead_peer_at_end_times_out_with_record() {
    let p = Protocol {
        timeout_ns: NS_PER_CLOCK_READ / 2,
        dies: Some((1, 1, BarrierKind::End)),
        ..Protocol::new(2, 1, 2, false)
    };
    model_with_death(p, 2, |o| {
        assert_eq!(o[1], Outcome::Died);
        assert_eq!(
            o[0],
            Outcome::Failed(timeout_record(1, 2, BarrierKind::End))
        );
    });
}

/// A dead rank among three: both survivors time out, each naming it. The
/// survivors also wait for each other, which always succeeds.
#[test]
fn dead_peer_among_three_is_named_by_both_survivors() {
    let p = Protocol {
        timeout_ns: NS_PER_CLOCK_READ / 2,
        dies: Some((2, 0, BarrierKind::Start)),
        ..Protocol::new(3, 1, 1, false)
    };
    model_with_death(p, 1, |o| {
        assert_eq!(o[2], Outcome::Died);
        for (r, out) in o.iter().enumerate().take(2) {
            let want = ErrorRecord {
                rank: r as u32,
                ..timeout_record(2, 1, BarrierKind::Start)
            };
            assert_eq!(out, &Outcome::Failed(want), "rank {r}");
        }
    });
}

/// With a finite timeout and every rank alive, loom also explores the
/// schedules in which a peer is merely slow: every execution must end
/// (no hang), and each rank either completes with the right sum or leaves a
/// consistent record naming a real peer and a real barrier; a rank never
/// reads a wrong value (checked inside the model).
#[test]
fn slow_peer_ends_in_success_or_consistent_timeout() {
    let p = Protocol {
        timeout_ns: NS_PER_CLOCK_READ / 2,
        ..Protocol::new(2, 1, 1, false)
    };
    builder(1).check(move || {
        let outcomes = run_world(p);
        for (r, o) in outcomes.iter().enumerate() {
            match o {
                Outcome::Done(v) => assert_eq!(v, &vec![expected_sum(0, 2, 0)], "rank {r}"),
                Outcome::Failed(rec) => {
                    assert_eq!(rec.code, error_code::PEER_TIMEOUT, "rank {r}: {rec:?}");
                    assert_eq!(rec.rank, r as u32, "rank {r}: {rec:?}");
                    assert_eq!(rec.epoch, 1, "rank {r}: {rec:?}");
                    // A rank's own arrival is always there: only the other
                    // rank can be the one that did not come.
                    assert_eq!(rec.peer, 1 - r as u32, "rank {r}: {rec:?}");
                    assert!(
                        BarrierKind::from_u32(rec.barrier).is_some(),
                        "rank {r}: {rec:?}"
                    );
                }
                Outcome::Died => panic!("rank {r} died but none was told to"),
            }
        }
    });
}

/// Runs a model that must fail, and returns loom's (or the model's) panic
/// message; panics if every execution passed.
fn model_failure(p: Protocol, preemptions: usize) -> String {
    let result = std::panic::catch_unwind(move || model_completes(p, preemptions));
    let payload =
        result.expect_err("the model passed without the barrier: it cannot detect the bug");
    if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else if let Some(s) = payload.downcast_ref::<&str>() {
        s.to_string()
    } else {
        String::from("<non-string panic>")
    }
}

/// Without the end barrier a fast rank overwrites its input for the next
/// collective while a slow peer still reads it: loom must find that
/// execution. This (and the next test) proves the model can fail.
#[test]
fn one_stage_without_end_barrier_is_caught() {
    let p = Protocol {
        end_barrier: false,
        ..Protocol::new(2, 1, 2, false)
    };
    let msg = model_failure(p, 2);
    assert!(
        msg.contains("Causality violation"),
        "unexpected failure: {msg}"
    );
}

/// Without the mid barrier a rank reads a peer's scratch before the peer
/// wrote it: either loom sees the race, or the value read is the old one.
#[test]
fn two_stage_without_mid_barrier_is_caught() {
    let p = Protocol {
        mid_barrier: false,
        ..Protocol::new(2, 2, 1, true)
    };
    let msg = model_failure(p, 2);
    assert!(
        msg.contains("Causality violation") || msg.contains("is stale"),
        "unexpected failure: {msg}"
    );
}
