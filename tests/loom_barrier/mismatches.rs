//! Ranks whose calls differ (issue 43): neither completes.

use super::*;

/// Two ranks whose calls differ (issue 43): the engines' shapes, each rank
/// with the tag its real call has (`call_tag::CallDesc`) and the shorter
/// rank with fewer elements. Neither rank may end its call in `Done`: each
/// times out, and the word the peer left where it waited is the peer's
/// call at this epoch under the peer's tag, which is what the host turns
/// into `CallMismatch` (host/collective.rs, `other_call`).
fn ranks_that_disagree(algo: Algorithm, short: CallDesc, long: CallDesc) {
    let (ts, tl) = (short.tag(), long.tag());
    assert_ne!(ts, tl, "{short} vs {long}");
    let p = Protocol {
        timeout_ns: TIMEOUT_NS,
        tags: [ts, tl, 0, 0],
        short: Some((0, 1)),
        ..Protocol::kernels(2, 2, 1, algo)
    };
    builder(1).check(move || {
        let (outcomes, world) = run_world_mem(p);
        for (me, o) in outcomes.iter().enumerate() {
            let Outcome::Failed(rec) = o else {
                panic!("{algo:?}: rank {me} ended {o:?}, not in a timeout: {short} vs {long}");
            };
            let (peer, theirs) = (1 - me, [ts, tl][1 - me]);
            assert_eq!(rec.code, error_code::PEER_TIMEOUT);
            assert_eq!(rec.peer as usize, peer);
            assert_eq!(
                rec.tag,
                [ts, tl][me],
                "the record carries the waiter's own tag"
            );
            let kind = BarrierKind::from_u32(rec.barrier).expect("a barrier kind");
            let mem = &world[me];
            // What the host reads where the wait timed out.
            let left = if algo == Algorithm::PushLl {
                let pack = mem.ll_pack(rec.epoch, p.landing_slots, peer, 0);
                let w = |k: usize| (pack.words[k].load(Ordering::Acquire) >> 32) as u32;
                ll_tag([w(0), w(1), w(2), w(3)], rec.epoch)
            } else {
                let v = mem.slot(kind, peer).0.load(Ordering::Acquire);
                (v as u32 == rec.epoch).then_some((v >> 32) as u32)
            };
            assert_eq!(
                left,
                Some(theirs),
                "{algo:?}: rank {me} must see the peer's call"
            );
        }
    });
}

#[test]
fn ranks_that_disagree_never_complete_one_stage() {
    ranks_that_disagree(
        Algorithm::OneStage,
        CallDesc::plain(3 * 7168, p2p_allreduce::Dtype::Bf16, Algorithm::OneStage),
        CallDesc::plain(4 * 7168, p2p_allreduce::Dtype::Bf16, Algorithm::OneStage),
    );
}

#[test]
fn ranks_that_disagree_never_complete_two_stage() {
    ranks_that_disagree(
        Algorithm::TwoStage,
        CallDesc::plain(8192, p2p_allreduce::Dtype::F16, Algorithm::TwoStage),
        CallDesc::plain(2 * 8192, p2p_allreduce::Dtype::F16, Algorithm::TwoStage),
    );
}

#[test]
fn ranks_that_disagree_never_complete_push() {
    ranks_that_disagree(
        Algorithm::Push,
        CallDesc::plain(1000, p2p_allreduce::Dtype::F32, Algorithm::Push),
        CallDesc::plain(1256, p2p_allreduce::Dtype::F32, Algorithm::Push),
    );
}

#[test]
fn ranks_that_disagree_never_complete_push_ll() {
    ranks_that_disagree(
        Algorithm::PushLl,
        CallDesc::fused(3, 7168, p2p_allreduce::Dtype::Bf16, Algorithm::PushLl),
        CallDesc::fused(4, 7168, p2p_allreduce::Dtype::Bf16, Algorithm::PushLl),
    );
}

#[test]
fn ranks_that_disagree_never_complete_push_two_stage() {
    ranks_that_disagree(
        Algorithm::PushTwoStage,
        CallDesc::plain(
            3 * 7168,
            p2p_allreduce::Dtype::Bf16,
            Algorithm::PushTwoStage,
        ),
        CallDesc::plain(
            4 * 7168,
            p2p_allreduce::Dtype::Bf16,
            Algorithm::PushTwoStage,
        ),
    );
}
