//! Push: each part of the protocol is needed.

use super::*;

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
