//! The call tag against the disagreements engines make (issue 43): ranks
//! whose calls differ must carry different tags, or the shorter rank can
//! take the longer rank's words for its own and return with wrong bits.
//!
//! Each promise of `host/call_tag.rs` is tried whole where it is finite
//! (every hidden size that is a multiple of 64 in 512..=32768 against every
//! pair of batch sizes in 1..=4096; every equal product of rows x hidden),
//! and by proptest where it is not (counts off by 1..=65536 from any base;
//! dtype and count changed together; the closed-form collision rule). A
//! chunked message carries its whole call's tag in every chunk.

use p2p_allreduce::call_tag::{CallDesc, P, X};
use p2p_allreduce::plan::{Inputs, Plan, Request};
use p2p_allreduce::{AlgoChoice, Algorithm, Config, Dtype, Link};
use proptest::prelude::*;
use proptest::sample::select;

/// Hidden sizes of the promise: multiples of 64 in 512..=32768.
fn hidden_sizes() -> impl Iterator<Item = usize> {
    (512..=32768).step_by(64)
}

/// Batch sizes (tokens per step) of the promise.
const MAX_BATCH: usize = 4096;

/// The tag's value for fields that do not change it between the two
/// calls compared: every tag below differs from another only through the
/// count (and hidden) field, so one dtype/algorithm pair per kind stands
/// for all, and two more pairs check that the fields stay apart.
const KINDS: [(Dtype, Algorithm); 3] = [
    (Dtype::Bf16, Algorithm::OneStage),
    (Dtype::F16, Algorithm::TwoStage),
    (Dtype::F32, Algorithm::PushLl),
];

/// Sorted, then no two neighbours equal: all distinct.
fn all_distinct(mut tags: Vec<u32>) -> bool {
    tags.sort_unstable();
    tags.windows(2).all(|w| w[0] != w[1])
}

#[test]
fn every_hidden_size_every_pair_of_batch_sizes() {
    for (dtype, algorithm) in KINDS {
        for h in hidden_sizes() {
            let plain: Vec<u32> = (1..=MAX_BATCH)
                .map(|k| CallDesc::plain(k * h, dtype, algorithm).tag())
                .collect();
            assert!(all_distinct(plain), "plain k x {h} {dtype:?} {algorithm:?}");
            let fused: Vec<u32> = (1..=MAX_BATCH)
                .map(|k| CallDesc::fused(k, h, dtype, algorithm).tag())
                .collect();
            assert!(all_distinct(fused), "fused k x {h} {dtype:?} {algorithm:?}");
        }
    }
}

#[test]
fn every_equal_product_of_rows_and_hidden() {
    // (product, tag) of every fused call rows x hidden, rows 1..=4096 and
    // hidden a multiple of 64 up to 32768 (smaller ones too: 64..512).
    for (dtype, algorithm) in KINDS {
        let mut calls: Vec<(usize, u32, usize)> = (64..=32768)
            .step_by(64)
            .flat_map(|h| {
                (1..=MAX_BATCH)
                    .map(move |r| (r * h, CallDesc::fused(r, h, dtype, algorithm).tag(), h))
            })
            .collect();
        calls.sort_unstable();
        let mut groups = 0;
        for w in calls.windows(2) {
            if w[0].0 == w[1].0 {
                groups += 1;
                assert_ne!(
                    w[0].1, w[1].1,
                    "rows x hidden with product {}: hidden {} and {} share a tag",
                    w[0].0, w[0].2, w[1].2
                );
            }
        }
        // The test saw what it claims to: many equal products.
        assert!(groups > 100_000, "{groups} equal-product pairs");
    }
}

#[test]
fn the_engines_shapes_of_issue_43() {
    let t =
        |rows: usize, h: usize| CallDesc::plain(rows * h, Dtype::Bf16, Algorithm::TwoStage).tag();
    assert_ne!(t(3, 7168), t(4, 7168));
    assert_ne!(t(1, 8192), t(2, 8192));
    assert_ne!(t(7, 4096), t(8, 4096));
    let f = |rows: usize| CallDesc::fused(rows, 7168, Dtype::Bf16, Algorithm::PushLl).tag();
    assert_ne!(f(3), f(4));
    for c in [0usize, 1, 1000, 21_504, 1 << 20] {
        for algorithm in Algorithm::ALL {
            let a = CallDesc::plain(c, Dtype::F32, algorithm).tag();
            assert_ne!(a, CallDesc::plain(c + 256, Dtype::F32, algorithm).tag());
        }
    }
}

/// A chunked message: the tag of each chunk is the whole call's, so two
/// ranks whose counts differ only in the number of chunks, or only in the
/// last chunk, differ in the first chunk already.
#[test]
fn every_chunk_carries_the_whole_calls_tag() {
    let config = Config {
        max_bytes: 64 * 1024,
        ..Config::default()
    };
    let plan = |count: usize| {
        Plan::new(
            &config,
            Request {
                dtype: Dtype::F32,
                count,
                world: 2,
                link: Link::NvLink,
                virtual_ranks: false,
                inputs: Inputs::Staged,
                choice: AlgoChoice::OneStage,
            },
        )
        .expect("a staged plan of a chunked message")
    };
    let chunk = 16 * 1024; // f32 elements of 64 KiB
    for (a, b) in [
        (3 * chunk, 4 * chunk),         // the number of chunks
        (3 * chunk + 5, 3 * chunk + 6), // the last chunk
        (2 * chunk + 7, 3 * chunk + 7),
    ] {
        let (pa, pb) = (plan(a), plan(b));
        assert!(pa.steps().count() > 1, "{a} elements are chunked");
        assert_eq!(pa.call().count, a);
        assert_eq!(pb.call().count, b);
        assert_ne!(pa.call().tag(), pb.call().tag(), "{a} vs {b}");
        // Their first chunks are alike in every other respect.
        let (fa, fb) = (pa.steps().next().unwrap(), pb.steps().next().unwrap());
        assert_eq!((fa.offset, fa.len, fa.entry), (fb.offset, fb.len, fb.entry));
    }
}

fn dtypes() -> impl Strategy<Value = Dtype> {
    select(Dtype::ALL.to_vec())
}

fn algorithms() -> impl Strategy<Value = Algorithm> {
    select(Algorithm::ALL.to_vec())
}

/// The closed form of `host/call_tag.rs`: whether two calls share a tag.
fn collide(a: &CallDesc, b: &CallDesc) -> bool {
    let field = |c: &CallDesc| (c.count as u64 % P + X * (c.hidden as u64 % P)) % P;
    a.dtype == b.dtype
        && a.algorithm == b.algorithm
        && (a.hidden != 0) == (b.hidden != 0)
        && field(a) == field(b)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    /// From any base count, every count up to 65536 more has its own tag.
    #[test]
    fn counts_off_by_up_to_65536(base in prop_oneof![0usize..70_000, 0usize..(1 << 40)],
                                 dtype in dtypes(), algorithm in algorithms()) {
        let tags: Vec<u32> = (base..=base + 65_536)
            .map(|c| CallDesc::plain(c, dtype, algorithm).tag())
            .collect();
        prop_assert!(all_distinct(tags));
    }

    /// Another dtype (with any count, e.g. the same bytes), another
    /// algorithm, or fused against plain: always another tag.
    #[test]
    fn dtype_algorithm_or_kind_changed(c1 in 0usize..(1 << 36), c2 in 0usize..(1 << 36),
                                       d1 in dtypes(), d2 in dtypes(),
                                       a1 in algorithms(), a2 in algorithms(),
                                       rows in 1usize..5000, hidden in 1usize..70_000) {
        if d1 != d2 || a1 != a2 {
            prop_assert_ne!(CallDesc::plain(c1, d1, a1).tag(), CallDesc::plain(c2, d2, a2).tag());
            prop_assert_ne!(CallDesc::fused(rows, hidden, d1, a1).tag(),
                            CallDesc::fused(rows, hidden, d2, a2).tag());
        }
        prop_assert_ne!(CallDesc::plain(c1, d1, a1).tag(), CallDesc::fused(rows, hidden, d1, a1).tag());
        // Same bytes, another dtype.
        let bytes_f32 = CallDesc::plain(c1, Dtype::F32, a1).tag();
        prop_assert_ne!(bytes_f32, CallDesc::plain(2 * c1, Dtype::Bf16, a1).tag());
        prop_assert_ne!(bytes_f32, CallDesc::plain(2 * c1, Dtype::F16, a1).tag());
    }

    /// The collision rule is exact: tags agree exactly where the closed
    /// form says, for random pairs and for pairs built to collide.
    #[test]
    fn collisions_are_exactly_the_closed_form(c in 0usize..(1 << 40), d in 0usize..(1 << 30),
                                              k in 1usize..20, hidden in 0usize..100_000,
                                              dh in 0usize..100_000,
                                              dtype in dtypes(), algorithm in algorithms()) {
        let desc = |count: usize, hidden: usize| CallDesc {
            count,
            dtype,
            algorithm,
            rows: count.checked_div(hidden).unwrap_or(0),
            hidden,
        };
        for (a, b) in [
            (desc(c, 0), desc(c + d, 0)),
            (desc(c, 0), desc(c + k * P as usize, 0)),
            (desc(c, hidden), desc(c + d, hidden + dh)),
            // Built to collide: the count makes up for the hidden size.
            (desc(c + X as usize * dh, hidden), desc(c, hidden + dh)),
        ] {
            prop_assert_eq!(a.tag() == b.tag(), collide(&a, &b), "{} vs {}", a, b);
        }
    }
}
