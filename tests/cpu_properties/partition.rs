//! The work decomposition: partitions tile the packs.

use super::*;

/// The partition invariants for one (packs, world).
fn check_partition(packs: u64, world: u32) -> Result<(), String> {
    let mut expected_start = 0;
    let (lo, hi) = (packs / world as u64, packs.div_ceil(world as u64));
    for p in 0..world {
        let (s, e) = partition(packs, world, p);
        let ctx = || format!("partition({packs}, {world}, {p}) = ({s}, {e})");
        if s != expected_start {
            return Err(format!(
                "{}: does not start where part {} ended ({expected_start})",
                ctx(),
                p as i64 - 1
            ));
        }
        if e < s || e - s < lo || e - s > hi {
            return Err(format!(
                "{}: length {} outside [{lo}, {hi}]",
                ctx(),
                e.wrapping_sub(s)
            ));
        }
        expected_start = e;
    }
    if expected_start != packs {
        return Err(format!(
            "partitions of {packs} packs for world {world} end at {expected_start}"
        ));
    }
    Ok(())
}

proptest! {
    #![proptest_config(config(4000))]

    #[test]
    fn partitions_tile_the_packs(packs in 0u64..=10_000_000, world in 1u32..=MAX_RANKS as u32) {
        check_partition(packs, world).map_err(TestCaseError::fail)?;
    }

    #[test]
    fn split_is_packs_plus_short_tail(count in any::<u64>(), lanes in select(vec![4u64, 8])) {
        let s = split(count, lanes);
        prop_assert!(s.tail < lanes, "split({}, {}) = {:?}", count, lanes, s);
        prop_assert_eq!(s.packs as u128 * lanes as u128 + s.tail as u128, count as u128,
            "split({}, {}) = {:?}", count, lanes, s);
    }
}

/// Exhaustive for small sizes, with an explicit coverage count per pack.
#[test]
fn partitions_cover_every_pack_once_exhaustive() {
    for world in 1..=MAX_RANKS as u32 {
        for packs in 0..=600u64 {
            check_partition(packs, world).unwrap();
            let mut seen = vec![0u8; packs as usize];
            for p in 0..world {
                let (s, e) = partition(packs, world, p);
                for i in s..e {
                    seen[i as usize] += 1;
                }
            }
            let bad = seen.iter().position(|&c| c != 1);
            assert_eq!(
                bad, None,
                "world {world} packs {packs}: pack covered {seen:?}"
            );
        }
    }
    // Sizes near the top of the range the property test samples.
    for world in 1..=MAX_RANKS as u32 {
        for packs in [9_999_993, 9_999_999, 10_000_000, u32::MAX as u64 + 7] {
            check_partition(packs, world).unwrap();
        }
    }
}
