//! Timeouts: a rank that dies or is late; every other rank ends with a
//! record naming it.

use super::*;

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
