//! The pull algorithms (one-stage, two-stage): the kernels' barrier table
//! completes, and each barrier and each hardware assumption is needed.

use super::*;

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
// The model can fail: each barrier and each hardware assumption is needed.

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
