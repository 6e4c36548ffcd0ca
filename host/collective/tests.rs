//! Unit tests of the collective core: signals, health, `check` and `reset`.

use super::*;

#[test]
fn a_word_of_another_call_is_told_from_a_stale_or_own_one() {
    use crate::abi::{flag_word, ll_highs, LaunchArgs, MISMATCH_FLIP};
    let e = 0x0012_3457;
    let args = |tag: u32| LaunchArgs {
        call_tag: tag,
        ..Default::default()
    };
    let mine = 0x1234_563a;
    // What the kernels store, as flags and as LL packs.
    let flag = |tag: u32, epoch: u32| PeerWord::Flag(flag_word(epoch, &args(tag), 0));
    let ll = |tag: u32, epoch: u32| PeerWord::Ll(ll_highs(epoch, &args(tag), 0));
    let kinds: [&dyn Fn(u32, u32) -> PeerWord; 2] = [&flag, &ll];
    for word in kinds {
        let theirs = 0x1234_565c;
        assert_eq!(other_call(word(theirs, e), e, mine), Some(theirs));
        // Tags that differ only in their high bytes (the count field).
        assert_eq!(
            other_call(word(mine ^ 0x4000_0000, e), e, mine),
            Some(mine ^ 0x4000_0000)
        );
        assert_eq!(
            other_call(word(mine, e), e, mine),
            None,
            "this rank's own call"
        );
        assert_eq!(
            other_call(word(theirs, e - 2), e, mine),
            None,
            "an older collective"
        );
    }
    assert_eq!(
        other_call(PeerWord::Flag(0), e, mine),
        None,
        "never written"
    );
    assert_eq!(
        other_call(PeerWord::Ll([0; 4]), e, mine),
        None,
        "never written"
    );
    // An injected flip is another call too.
    let flipped = LaunchArgs {
        call_tag: mine,
        mismatched_ranks: 0b10,
        ..Default::default()
    };
    for v in [
        PeerWord::Flag(flag_word(e, &flipped, 1)),
        PeerWord::Ll(ll_highs(e, &flipped, 1)),
    ] {
        assert_eq!(other_call(v, e, mine), Some(mine ^ MISMATCH_FLIP));
    }
    assert_eq!(
        PeerWord::Flag(flag_word(e, &flipped, 0)),
        flag(mine, e),
        "rank 0 is not flipped"
    );
}

#[test]
fn epoch_after_counts_as_the_kernels_do() {
    for start in [0u32, 1, 2, 3, 1000, u32::MAX - 5, u32::MAX] {
        let mut e = start;
        for k in 0..20u32 {
            assert_eq!(epoch_after(start, k), e, "{start} + {k}");
            e = next_epoch(e);
        }
    }
    assert_eq!(epoch_after(2, u32::MAX - 1), 2, "a whole period");
    assert_eq!(epoch_after(2, u32::MAX), 3, "a whole period and one");
}
use crate::ptx::{Entry, Op};

fn step(algorithm: Algorithm, offset: usize, len: usize) -> Step {
    Step {
        offset,
        len,
        entry: Entry {
            op: Op::Allreduce,
            algorithm,
            dtype: Dtype::F32,
            world: 2,
            virtual_ranks: false,
        },
        blocks: 1,
    }
}

fn by(ptrs: &[u64]) -> [u64; MAX_RANKS] {
    let mut a = [0u64; MAX_RANKS];
    a[..ptrs.len()].copy_from_slice(ptrs);
    a
}

/// A PeerGroup launches one member per rank: the member of rank 0 must
/// see that rank 1's output (another member's) lies over its input,
/// as the crossed buffers on two ranks of one GPU do.
#[test]
fn push_ll_reads_in_place_only_where_no_output_of_the_call_overlaps() {
    let (a, b, x, y) = (0x10_0000u64, 0x20_0000u64, 0x30_0000u64, 0x40_0000u64);
    let n = 1000; // 4000 bytes of f32
    let s = step(Algorithm::PushLl, 0, n);
    let one = |r: usize| std::iter::once(r);
    // Distinct buffers: in place for every member.
    assert!(direct_input(&s, one(0), n, &by(&[a, b]), &by(&[x, y]), 4));
    assert!(direct_input(&s, 0..2, n, &by(&[a, b]), &by(&[x, y]), 4));
    // In place (a rank's output exactly over its own input): allowed.
    assert!(direct_input(&s, one(0), n, &by(&[a, b]), &by(&[a, b]), 4));
    // Crossed: rank 0's output is rank 1's input and the other way
    // round. Each member alone owns one rank; both must stage.
    let (ins, outs) = (by(&[a, b]), by(&[b, a]));
    assert!(!direct_input(&s, one(0), n, &ins, &outs, 4));
    assert!(!direct_input(&s, one(1), n, &ins, &outs, 4));
    assert!(!direct_input(&s, 0..2, n, &ins, &outs, 4));
    // Another rank's output overlapping only part of the message, in a
    // later step's range: the whole call stages.
    let late = by(&[x, a + 3000]);
    let first = step(Algorithm::PushLl, 0, 256);
    assert!(!direct_input(&first, one(0), n, &ins, &late, 4));
    // The rank's own output shifted over its input: staged.
    assert!(!direct_input(&s, one(0), n, &ins, &by(&[a + 16, y]), 4));
    // A rank of another process (output 0) is not an overlap.
    assert!(direct_input(&s, one(0), n, &ins, &by(&[x, 0]), 4));
    // Misaligned at the step's offset, or another algorithm: staged.
    assert!(!direct_input(
        &s,
        one(0),
        n,
        &by(&[a + 4, b]),
        &by(&[x, y]),
        4
    ));
    assert!(!direct_input(
        &step(Algorithm::Push, 0, n),
        one(0),
        n,
        &ins,
        &by(&[x, y]),
        4
    ));
}
