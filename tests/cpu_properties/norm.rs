//! The fused RMSNorm's decomposition: the sum of squares as the kernels
//! spread it over a block (`kernels/norm/tree.rs`: chunk k in thread k mod
//! nthreads, `tree_sum` with warp shuffles and a quarter stage in warp 0),
//! modelled step by step from the device crate's pure pieces
//! (`norm_tree::{warp_adds, combine_quarters}`, the `Element` conversions),
//! against the tree's definition and against the CPU oracle.

use super::*;
use p2p_allreduce::abi::{NORM_CHUNK, NORM_MAX_CHUNKS};
use p2p_allreduce::device::norm_tree::{self, combine_quarters, warp_adds, QUARTERS};

/// The warp's width, as the model's `u64` indices.
const WARP: u64 = norm_tree::WARP as u64;

/// `warp_tree` of one warp: `v[l]` is lane l's item, +0.0 where the item
/// does not exist (as the kernels load it); at each stride (in the order of
/// `strides`) a lane reads the value `s` lanes above it as `shfl.down` does
/// (its own value when that lane is past the warp), then adds it if
/// `warp_adds` says so. Lane 0's value is returned.
fn model_warp_tree(v: &mut [f32; 32], strides: &[u64]) -> f32 {
    for &s in strides {
        let before = *v;
        for l in 0..32u64 {
            let other = if l + s < WARP {
                before[(l + s) as usize]
            } else {
                before[l as usize]
            };
            if warp_adds(l as u32, s as u32) {
                v[l as usize] += other;
            }
        }
    }
    v[0]
}

/// `tree_sum` over the partials `parts` with `nthreads` threads.
fn model_tree_sum(parts: &[f32], nthreads: u64) -> f32 {
    model_tree_sum_with(parts, nthreads, &STRIDES, combine_quarters)
}

/// The strides of `warp_tree`, in its order.
const STRIDES: [u64; 5] = [1, 2, 4, 8, 16];

/// [`model_tree_sum`] with the warp's stride order and the quarter stage
/// as parameters (the tests' mutants replace them).
fn model_tree_sum_with(
    parts: &[f32],
    nthreads: u64,
    strides: &[u64],
    combine: fn([f32; QUARTERS], u32) -> f32,
) -> f32 {
    let chunks = parts.len() as u64;
    let mut sh = parts.to_vec();
    for slot in 0..chunks.div_ceil(nthreads) {
        for w in 0..nthreads / WARP {
            let mut v = [0f32; 32];
            let mut ks = [0u64; 32];
            for l in 0..32u64 {
                let k = slot * nthreads + w * WARP + l;
                ks[l as usize] = k;
                v[l as usize] = if k < chunks { sh[k as usize] } else { 0.0 };
            }
            let first = model_warp_tree(&mut v, strides);
            if ks[0] < chunks {
                sh[ks[0] as usize] = first;
            }
        }
    }
    let groups = chunks.div_ceil(WARP);
    let mut a = [0f32; QUARTERS];
    for (j, q) in a.iter_mut().enumerate() {
        let mut v = [0f32; 32];
        for l in 0..32u64 {
            let g = WARP * j as u64 + l;
            v[l as usize] = if g < groups {
                sh[(WARP * g) as usize]
            } else {
                0.0
            };
        }
        *q = model_warp_tree(&mut v, strides);
    }
    combine(a, groups as u32)
}

/// The tree by its recursive reading (written here, not from the device
/// crate): with P the smallest power of two >= n, the last stride P/2
/// adds the tree of [P/2, n) onto the tree of [0, P/2).
fn tree_by_halves(parts: &[f32]) -> f32 {
    match parts.len() {
        0 => 0.0,
        1 => parts[0],
        n => {
            let half = n.next_power_of_two() / 2;
            tree_by_halves(&parts[..half]) + tree_by_halves(&parts[half..])
        }
    }
}

/// Non-negative partials (sums of squares) over many binades.
fn partials(n: usize, seed: u64) -> Vec<f32> {
    let mut x = seed | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let e = (x % 60) as i32 - 30;
            (1.0 + (x >> 40) as f32 / (1u64 << 24) as f32) * 2f32.powi(e)
        })
        .collect()
}

/// Threads per block the kernels accept: multiples of 32 up to 1024.
fn block_threads() -> impl Strategy<Value = u64> {
    (1u64..=32).prop_map(|w| w * WARP)
}

/// One row of the fused operation as a block computes it: residual add
/// per element (`E` conversions), squares per chunk in column order, the
/// modelled `tree_sum`, `inv`, the normed row.
fn model_norm_row<E: Element>(
    sum: &[u32],
    res: &[u32],
    gamma: &[u32],
    eps: f32,
    nthreads: u64,
) -> (Vec<u32>, Vec<u32>) {
    let hidden = gamma.len();
    let res_out: Vec<u32> = (0..hidden)
        .map(|j| E::from_f32(E::to_f32(sum[j]) + E::to_f32(res[j])))
        .collect();
    let q: Vec<f32> = res_out.iter().map(|&b| E::to_f32(b)).collect();
    let parts: Vec<f32> = q
        .chunks(NORM_CHUNK)
        .map(|c| c.iter().skip(1).fold(c[0] * c[0], |acc, v| acc + v * v))
        .collect();
    let total = model_tree_sum(&parts, nthreads);
    let inv = 1.0 / (total / hidden as f32 + eps).sqrt();
    let normed = (0..hidden)
        .map(|j| E::from_f32((q[j] * inv) * E::to_f32(gamma[j])))
        .collect();
    (res_out, normed)
}

fn check_fused_model(
    dtype: Dtype,
    world: usize,
    rows: usize,
    hidden: usize,
    nthreads: u64,
    seed: u64,
) -> Result<(), TestCaseError> {
    let count = rows * hidden;
    let x = values::adversarial_inputs(dtype, world, count, seed, false);
    let res = values::adversarial_inputs(dtype, 1, count, seed + 1, false).remove(0);
    let gamma = values::adversarial_inputs(dtype, 1, hidden, seed + 2, false).remove(0);
    let eps = 1e-6f32;
    let refs = as_slices(&x);
    let sum = reference::allreduce_bits(dtype, &refs);
    let (want_res, want_norm) = reference::add_rmsnorm_bits(dtype, &refs, &res, &gamma, eps);
    let (mut got_res, mut got_norm) = (Vec::new(), Vec::new());
    for row in 0..rows {
        let at = row * hidden..(row + 1) * hidden;
        let (r, n) = match dtype {
            Dtype::F32 => model_norm_row::<F32>(&sum[at.clone()], &res[at], &gamma, eps, nthreads),
            Dtype::F16 => model_norm_row::<F16>(&sum[at.clone()], &res[at], &gamma, eps, nthreads),
            Dtype::Bf16 => {
                model_norm_row::<Bf16>(&sum[at.clone()], &res[at], &gamma, eps, nthreads)
            }
        };
        got_res.extend(r);
        got_norm.extend(n);
    }
    let what = format!(
        "{} world={world} rows={rows} hidden={hidden} threads={nthreads} seed={seed:#x}",
        dtype.name()
    );
    for (name, got, want) in [
        ("residual out", &got_res, &want_res),
        ("normed", &got_norm, &want_norm),
    ] {
        if let Some((i, g, w)) = reference::first_mismatch(dtype, got, want) {
            return Err(TestCaseError::fail(format!(
                "{what}: {name} element {i}: model {} oracle {}",
                fmt_bits(dtype, g),
                fmt_bits(dtype, w)
            )));
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(config(400))]

    /// The block's spread of the tree gives the tree's sum, bit for bit,
    /// for every row length the kernels take and every block size.
    #[test]
    fn tree_sum_model_is_the_pairwise_tree(chunks in 1usize..=NORM_MAX_CHUNKS, nthreads in block_threads(), seed in any::<u64>()) {
        let parts = partials(chunks, seed);
        let model = model_tree_sum(&parts, nthreads);
        let halves = tree_by_halves(&parts);
        prop_assert_eq!(model.to_bits(), halves.to_bits(), "chunks {} threads {}", chunks, nthreads);
    }

    /// Whole fused rows from the modelled decomposition equal the oracle.
    #[test]
    fn fused_model_matches_oracle(
        dtype in select(Dtype::ALL.to_vec()),
        world in 1usize..=MAX_RANKS,
        rows in 0usize..=4,
        hidden in prop_oneof![select(vec![1usize, 7, 8, 128, 4096, 5120, 7168, 8192]), 1usize..=NORM_MAX_CHUNKS * NORM_CHUNK],
        nthreads in block_threads(),
        seed in any::<u64>(),
    ) {
        check_fused_model(dtype, world, rows, hidden, nthreads, seed)?;
    }
}

/// Every row length at the block size the library launches (512) and at
/// one warp, exhaustively: the tree spread is right for all of them.
#[test]
fn tree_sum_model_every_length() {
    for chunks in 1..=NORM_MAX_CHUNKS {
        let parts = partials(chunks, chunks as u64);
        for nthreads in [32, 512] {
            assert_eq!(
                model_tree_sum(&parts, nthreads).to_bits(),
                tree_by_halves(&parts).to_bits(),
                "chunks {chunks} threads {nthreads}"
            );
        }
    }
}

/// [`model_tree_sum`] split over a cluster of `ctas` CTAs as the fused
/// push_ll splits a row (`kernels/norm/reg_rows.rs`, `ClusterRow`): CTA c reduces
/// chunks `[c * range, (c + 1) * range)` (`range` from
/// `abi::norm_split_range`, possibly none) with `nthreads` threads, then
/// one warp adds the CTAs' partials (lane c holds CTA c's, +0.0 past the
/// CTAs that hold chunks). `range_of` gives the range (the test's mutant
/// replaces it).
fn model_split_tree_sum(
    parts: &[f32],
    ctas: u64,
    nthreads: u64,
    range_of: fn(u64, u64) -> u64,
) -> f32 {
    let chunks = parts.len() as u64;
    let range = range_of(chunks, ctas);
    let mut v = [0f32; 32];
    for c in 0..ctas {
        let first = (c * range).min(chunks);
        let last = ((c + 1) * range).min(chunks);
        if first < last {
            v[c as usize] = model_tree_sum(&parts[first as usize..last as usize], nthreads);
        }
    }
    model_warp_tree(&mut v, &STRIDES)
}

/// Every row length, split over every cluster size the host launches
/// (with the block the plan gives a CTA's range, and one warp), is the
/// tree's sum bit for bit; an even split (ranges of `ceil(n / ctas)`, not a
/// power of two) is not, for some lengths: the model can fail.
#[test]
fn split_tree_sum_is_the_pairwise_tree() {
    use p2p_allreduce::abi::{norm_split_range, NORM_MAX_CTAS};
    let range_of: fn(u64, u64) -> u64 =
        |chunks, ctas| norm_split_range(chunks as u32, ctas as u32) as u64;
    let mut ctas = 1u64;
    while ctas <= NORM_MAX_CTAS as u64 {
        for chunks in 1..=NORM_MAX_CHUNKS {
            let parts = partials(chunks, 3 * chunks as u64 + ctas);
            let want = tree_by_halves(&parts).to_bits();
            let local = range_of(chunks as u64, ctas).min(chunks as u64);
            let plan_threads = local.div_ceil(2).div_ceil(WARP) * WARP;
            for nthreads in [WARP, plan_threads.clamp(WARP, 1024)] {
                let got = model_split_tree_sum(&parts, ctas, nthreads, range_of);
                assert_eq!(
                    got.to_bits(),
                    want,
                    "chunks {chunks} ctas {ctas} threads {nthreads}"
                );
            }
        }
        ctas *= 2;
    }
    let even: fn(u64, u64) -> u64 = |chunks, ctas| chunks.div_ceil(ctas);
    let caught = (1..=NORM_MAX_CHUNKS).step_by(13).any(|chunks| {
        let parts = partials(chunks, 5 + chunks as u64);
        model_split_tree_sum(&parts, 8, 512, even).to_bits() != tree_by_halves(&parts).to_bits()
    });
    assert!(caught, "an even (unaligned) split went unnoticed");
}

/// The model can fail: a warp that runs its strides from 16 down, or
/// quarters added one after the other, change the sum for some lengths.
#[test]
fn tree_sum_model_detects_wrong_spreads() {
    type Combine = fn([f32; QUARTERS], u32) -> f32;
    let sequential: Combine = |a, groups| {
        let mut t = a[0];
        for (j, q) in a.iter().enumerate().skip(1) {
            if norm_tree::WARP * (j as u32) < groups {
                t += q;
            }
        }
        t
    };
    let mutants: [(&str, &[u64], Combine); 2] = [
        ("strides from 16 down", &[16, 8, 4, 2, 1], combine_quarters),
        ("sequential quarters", &STRIDES, sequential),
    ];
    for (name, strides, combine) in mutants {
        let caught = (1..=NORM_MAX_CHUNKS).step_by(37).any(|chunks| {
            let parts = partials(chunks, 11 + chunks as u64);
            model_tree_sum_with(&parts, 512, strides, combine).to_bits()
                != tree_by_halves(&parts).to_bits()
        });
        assert!(caught, "the {name} mutant went unnoticed");
    }
}
