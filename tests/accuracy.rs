//! Accumulation error of the determinism contract (sum in f32, one rounding
//! to the element type at the end) against the exact sum, next to naive
//! accumulation in the element type (a rounding after every addition).
//!
//! `cargo test --test accuracy -- --nocapture` prints the table quoted in
//! `docs/numerics.md`. The data is fixed (seeded), so the numbers are too.

use approx::abs_diff_eq;
use p2p_allreduce::abi::Dtype;
use p2p_allreduce::reference::{self, as_slices, values};

/// Elements per rank in each measurement.
const LEN: usize = 50_000;
const WORLDS: [usize; 3] = [2, 4, 8];

#[derive(Clone, Copy, Debug)]
enum Dist {
    /// `u * 2^e`, `u` uniform in [-1, 1), `e` uniform in -4..=4: signed
    /// values over nine binades, like activations; sums cancel.
    Mixed,
    /// Uniform in [0, 1): no cancellation, the partial sums only grow.
    Positive,
}

impl Dist {
    const ALL: [Dist; 2] = [Dist::Mixed, Dist::Positive];
    fn name(self) -> &'static str {
        match self {
            Dist::Mixed => "mixed sign, 2^-4..2^4",
            Dist::Positive => "uniform [0, 1)",
        }
    }
    fn sample(self, state: &mut u64) -> f32 {
        let u = (values::splitmix64(state) >> 40) as f32 / (1u64 << 24) as f32;
        match self {
            Dist::Mixed => (2.0 * u - 1.0) * 2f32.powi(values::range_i32(state, -4, 4)),
            Dist::Positive => u,
        }
    }
}

/// The spacing of the element type's values at magnitude `x` (the
/// subnormal spacing below the normal range).
fn ulp(dtype: Dtype, x: f64) -> f64 {
    let fmt = values::Format::of(dtype);
    let e = if x == 0.0 {
        fmt.min_exp()
    } else {
        (x.abs().log2().floor() as i32).max(fmt.min_exp())
    };
    2f64.powi(e - fmt.mant_bits as i32)
}

/// Rounds an f64 to the element type once (nearest, ties to even).
fn round_to(dtype: Dtype, x: f64) -> f64 {
    match dtype {
        Dtype::F32 => x as f32 as f64,
        Dtype::F16 => half::f16::from_f64(x).to_f64(),
        Dtype::Bf16 => half::bf16::from_f64(x).to_f64(),
    }
}

/// Naive accumulation in the element type: every partial sum is rounded to
/// it, as a reduction with element-type adds would do. For f16/bf16 the
/// sum of two values of these data is exact in f64, so rounding that sum
/// once is the correctly rounded element-type addition.
fn naive(dtype: Dtype, column: &[u32]) -> f64 {
    match dtype {
        Dtype::F32 => {
            let mut acc = reference::widen(dtype, column[0]);
            for &b in &column[1..] {
                acc += reference::widen(dtype, b);
            }
            acc as f64
        }
        _ => {
            let mut acc = reference::widen(dtype, column[0]) as f64;
            for &b in &column[1..] {
                acc = round_to(dtype, acc + reference::widen(dtype, b) as f64);
            }
            acc
        }
    }
}

/// Errors of one method over a row's elements. Errors are in ulps of the
/// element type at the larger of the exact sum and the largest input (so a
/// sum that cancels to almost nothing is not divided by a tiny ulp), plus
/// the share of results equal to the correctly rounded exact sum.
#[derive(Default)]
struct Stats {
    sum_err: f64,
    max_err: f64,
    correctly_rounded: usize,
    n: usize,
}

impl Stats {
    fn add(&mut self, dtype: Dtype, got: f64, exact: f64, scale: f64) {
        let e = (got - exact).abs() / ulp(dtype, scale);
        self.sum_err += e;
        self.max_err = self.max_err.max(e);
        self.correctly_rounded += (got == round_to(dtype, exact)) as usize;
        self.n += 1;
    }
    fn mean(&self) -> f64 {
        self.sum_err / self.n as f64
    }
    fn pct_correct(&self) -> f64 {
        100.0 * self.correctly_rounded as f64 / self.n as f64
    }
}

struct Row {
    dtype: Dtype,
    world: usize,
    dist: Dist,
    ours: Stats,
    naive: Stats,
}

fn measure(dtype: Dtype, world: usize, dist: Dist, seed: u64) -> Row {
    let mut state = seed;
    let inputs: Vec<Vec<u32>> = (0..world)
        .map(|_| {
            (0..LEN)
                .map(|_| reference::narrow(dtype, dist.sample(&mut state)))
                .collect()
        })
        .collect();
    let ours_bits = reference::allreduce_bits(dtype, &as_slices(&inputs));
    let mut row = Row {
        dtype,
        world,
        dist,
        ours: Stats::default(),
        naive: Stats::default(),
    };
    for (i, &bits) in ours_bits.iter().enumerate() {
        let column: Vec<u32> = inputs.iter().map(|x| x[i]).collect();
        let exact = reference::sum_f64(dtype, &column);
        let ours = reference::widen(dtype, bits) as f64;
        // The contract's own error bound: each of the world - 1 f32
        // additions is off by at most 2^-24 of the sum of magnitudes, and
        // the final rounding by half an ulp of the element type (one ulp
        // here, as the rounded sum may sit in the binade above the exact).
        let magnitude: f64 = column
            .iter()
            .map(|&b| (reference::widen(dtype, b) as f64).abs())
            .sum();
        let bound = (world - 1) as f64 * 2f64.powi(-24) * magnitude + ulp(dtype, exact);
        assert!(
            abs_diff_eq!(ours, exact, epsilon = bound),
            "{} world {world} {}: element {i}: {ours:e} is {:e} from the exact {exact:e}, \
             more than the bound {bound:e}; inputs {column:x?}",
            dtype.name(),
            dist.name(),
            (ours - exact).abs()
        );
        let scale = column
            .iter()
            .map(|&b| (reference::widen(dtype, b) as f64).abs())
            .fold(exact.abs(), f64::max);
        row.ours.add(dtype, ours, exact, scale);
        row.naive.add(dtype, naive(dtype, &column), exact, scale);
    }
    row
}

#[test]
fn f32_accumulation_error_table() {
    let mut rows = Vec::new();
    for (d, dist) in Dist::ALL.into_iter().enumerate() {
        for dtype in Dtype::ALL {
            for world in WORLDS {
                let seed = 1000 * d as u64 + 10 * world as u64 + dtype as u64;
                rows.push(measure(dtype, world, dist, seed));
            }
        }
    }

    println!(
        "\n{LEN} elements per row. err: |result - exact sum| in ulps of the element type at the \
         larger of |exact sum| and the largest |input| (mean, max); exact: share of results \
         equal to the correctly rounded exact sum. ours = f32 accumulation in rank order, one \
         final rounding (the contract); naive = accumulation in the element type, rounded after \
         every addition.\n"
    );
    println!("| data | dtype | world | ours err mean | ours err max | ours exact | naive err mean | naive err max | naive exact |");
    println!("|---|---|---|---|---|---|---|---|---|");
    for r in &rows {
        println!(
            "| {} | {} | {} | {:.4} | {:.3} | {:.2}% | {:.4} | {:.3} | {:.2}% |",
            r.dist.name(),
            r.dtype.name(),
            r.world,
            r.ours.mean(),
            r.ours.max_err,
            r.ours.pct_correct(),
            r.naive.mean(),
            r.naive.max_err,
            r.naive.pct_correct()
        );
    }

    for r in &rows {
        let ctx = format!("{} world {} {}", r.dtype.name(), r.world, r.dist.name());
        if r.dtype == Dtype::F32 {
            // The same f32 additions in the same order: a check that the
            // naive model is what it claims.
            assert_eq!(r.ours.sum_err, r.naive.sum_err, "{ctx}");
            continue;
        }
        assert!(
            r.ours.mean() <= r.naive.mean() && r.ours.pct_correct() >= r.naive.pct_correct(),
            "{ctx}: f32 accumulation (mean {:.4} ulp, {:.2}% exact) is worse than naive \
             (mean {:.4} ulp, {:.2}% exact)",
            r.ours.mean(),
            r.ours.pct_correct(),
            r.naive.mean(),
            r.naive.pct_correct()
        );
        // With two ranks both methods round one sum once (up to a double
        // rounding of the f32 sum); beyond, f32 must be clearly better.
        if r.world >= 4 {
            assert!(
                r.ours.mean() < 0.8 * r.naive.mean(),
                "{ctx}: f32 accumulation ({:.4} ulp) not clearly better than naive ({:.4} ulp)",
                r.ours.mean(),
                r.naive.mean()
            );
        }
        // A few 16-bit values over nine binades sum exactly in f32, so
        // the result is the correctly rounded exact sum.
        assert_eq!(r.ours.pct_correct(), 100.0, "{ctx}");
        assert!(
            r.ours.max_err <= 0.5,
            "{ctx}: max error {} ulp",
            r.ours.max_err
        );
    }
}
