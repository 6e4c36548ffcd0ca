//! PushTwoStage: Start and Mid, both publishing; no End. PushIslands:
//! Start, Mid, Back between all ranks and Relay within island A, all
//! publishing; no End.

use super::*;

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
