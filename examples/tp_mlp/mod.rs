//! The tensor-parallel MLP block both examples run, and its CPU reference.
//!
//! One block of a transformer's MLP over `WORLD` ranks, as the engines
//! split it: the up projection column-parallel (rank r holds columns
//! `r*I/W..(r+1)*I/W` of `W_up`), the down projection row-parallel (the
//! same rows of `W_down`), so each rank ends with a partial `y_r` of the
//! whole output; then an allreduce sums the partials, the residual is
//! added, and the sum is RMS-normalised: one fused call
//! (`Comm::all_reduce_add_rms_norm`), or `all_reduce_in_place` and a norm
//! of the engine's own.
//!
//! The two GEMMs run on the host here (bf16 inputs, f32 accumulation,
//! rounded to bf16 as a GEMM's output is): this crate ships no GEMM, and an
//! engine's would be cuBLAS on the same stream. What runs on the GPU is the
//! communicator: its results are checked bit for bit against
//! [`p2p_allreduce::reference`], which every rank must match.

use half::bf16;
use p2p_allreduce::reference;
use p2p_allreduce::Dtype;

/// Tokens in the batch (rows).
pub const ROWS: usize = 8;
/// The model's hidden size.
pub const HIDDEN: usize = 1024;
/// The MLP's intermediate size (split over the ranks).
pub const INTER: usize = 2816;
/// RMSNorm's epsilon.
pub const EPS: f32 = 1e-6;

/// Deterministic values in about [-scale, scale), from a 64-bit LCG, as
/// bf16: the same on every rank and in the reference.
fn values(seed: u64, n: usize, scale: f32) -> Vec<bf16> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            let u = (s >> 40) as f32 / (1u64 << 24) as f32; // [0, 1)
            bf16::from_f32((2.0 * u - 1.0) * scale)
        })
        .collect()
}

/// The block's inputs and weights (every rank's copy).
pub struct Block {
    /// ROWS x HIDDEN, the block's input (after the previous norm).
    pub x: Vec<bf16>,
    /// ROWS x HIDDEN, the residual stream.
    pub residual: Vec<bf16>,
    /// HIDDEN x INTER, row-major.
    pub w_up: Vec<bf16>,
    /// INTER x HIDDEN, row-major.
    pub w_down: Vec<bf16>,
    /// HIDDEN, RMSNorm's weight.
    pub gamma: Vec<bf16>,
}

impl Block {
    pub fn new() -> Block {
        Block {
            x: values(1, ROWS * HIDDEN, 1.0),
            residual: values(2, ROWS * HIDDEN, 4.0),
            w_up: values(3, HIDDEN * INTER, 0.05),
            w_down: values(4, INTER * HIDDEN, 0.05),
            gamma: values(5, HIDDEN, 1.5),
        }
    }

    /// Rank `rank`'s partial output of `world`: `silu(x @ W_up[:, shard])
    /// @ W_down[shard, :]`, ROWS x HIDDEN bf16.
    pub fn partial(&self, rank: usize, world: usize) -> Vec<bf16> {
        assert_eq!(
            INTER % world,
            0,
            "INTER must split evenly over {world} ranks"
        );
        let shard = INTER / world;
        let cols = rank * shard..(rank + 1) * shard;
        let mut out = vec![bf16::ZERO; ROWS * HIDDEN];
        let mut h = vec![0f32; shard];
        for row in 0..ROWS {
            let x = &self.x[row * HIDDEN..(row + 1) * HIDDEN];
            // Column-parallel up projection + SiLU, rounded to bf16.
            for (j, c) in cols.clone().enumerate() {
                let mut acc = 0f32;
                for (k, xk) in x.iter().enumerate() {
                    acc += xk.to_f32() * self.w_up[k * INTER + c].to_f32();
                }
                let silu = acc / (1.0 + (-acc).exp());
                h[j] = bf16::from_f32(silu).to_f32();
            }
            // Row-parallel down projection: a partial sum of the output.
            for col in 0..HIDDEN {
                let mut acc = 0f32;
                for (j, c) in cols.clone().enumerate() {
                    acc += h[j] * self.w_down[c * HIDDEN + col].to_f32();
                }
                out[row * HIDDEN + col] = bf16::from_f32(acc);
            }
        }
        out
    }
}

fn bits(v: &[bf16]) -> Vec<u32> {
    v.iter().map(|x| u32::from(x.to_bits())).collect()
}

/// The reference of what every rank must get: the sum of the partials
/// (`all_reduce`), and the fused call's `(residual_out, normed)`.
pub struct Expected {
    pub sum: Vec<u32>,
    pub residual_out: Vec<u32>,
    pub normed: Vec<u32>,
}

pub fn expected(block: &Block, partials: &[Vec<bf16>]) -> Expected {
    let p: Vec<Vec<u32>> = partials.iter().map(|p| bits(p)).collect();
    let refs: Vec<&[u32]> = p.iter().map(Vec::as_slice).collect();
    let sum = reference::allreduce_bits(Dtype::Bf16, &refs);
    let (residual_out, normed) = reference::add_rmsnorm_bits(
        Dtype::Bf16,
        &refs,
        &bits(&block.residual),
        &bits(&block.gamma),
        EPS,
    );
    Expected {
        sum,
        residual_out,
        normed,
    }
}

/// Compares a rank's result with the reference, bit for bit.
pub fn check(rank: usize, what: &str, got: &[bf16], want: &[u32]) -> Result<(), String> {
    let got = bits(got);
    match reference::first_mismatch(Dtype::Bf16, &got, want) {
        None => Ok(()),
        Some((i, g, w)) => Err(format!(
            "rank {rank}: {what} differs from the CPU reference at element {i}: got {} want {}",
            reference::fmt_bits(Dtype::Bf16, g),
            reference::fmt_bits(Dtype::Bf16, w)
        )),
    }
}

/// Why the example cannot run here (no driver, no GPU), or `None`.
pub fn why_skip() -> Option<String> {
    if !p2p_allreduce::driver::driver_present() {
        return Some("no CUDA driver (libcuda not found)".into());
    }
    match p2p_allreduce::driver::device_count() {
        Ok(0) => Some("the CUDA driver sees no GPU".into()),
        Ok(_) => None,
        Err(e) => Some(format!("no usable GPU: {e}")),
    }
}

/// `--name value` from the command line.
pub fn arg(name: &str) -> Option<String> {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
}

/// `--name N`, or `default`.
pub fn arg_usize(name: &str, default: usize) -> usize {
    arg(name).map_or(default, |v| {
        v.parse()
            .unwrap_or_else(|_| panic!("{name} takes a number, got {v:?}"))
    })
}
