//! push_ll: the flag-in-data protocol (`device::ll`), no barrier.

use super::*;

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
