//! Validation cases: run one allreduce on real buffers and compare every
//! rank's result with the CPU reference ([`crate::reference`]) bit for bit.
//! Shared by `p2p-allreduce check`, the `#wrong` column of
//! `p2p-allreduce bench`, and tests.
//!
//! Inputs come from [`crate::reference::values::adversarial_inputs`] (seeded, so a failing
//! case is reproduced by its [`Case`] alone); outputs are filled with a
//! poison value before the run, so a kernel that skips an element is caught.
//! Device errors (a peer timeout recorded by the kernels, a driver error) are
//! returned as `Err`; wrong bits are an `Ok` [`Outcome`] with `wrong > 0`.

use crate::abi::{Algorithm, Dtype};
use crate::element::DeviceElement;
use crate::plan::AlgoChoice;
use crate::reference;
use std::fmt;

/// Element types whose raw bits travel as the low bits of a `u32`, the
/// representation of [`crate::reference`].
pub trait Bits: DeviceElement {
    fn from_bits32(bits: u32) -> Self;
    fn to_bits32(self) -> u32;
}

impl Bits for f32 {
    fn from_bits32(bits: u32) -> Self {
        f32::from_bits(bits)
    }
    fn to_bits32(self) -> u32 {
        self.to_bits()
    }
}

impl Bits for half::f16 {
    fn from_bits32(bits: u32) -> Self {
        half::f16::from_bits(bits as u16)
    }
    fn to_bits32(self) -> u32 {
        u32::from(self.to_bits())
    }
}

impl Bits for half::bf16 {
    fn from_bits32(bits: u32) -> Self {
        half::bf16::from_bits(bits as u16)
    }
    fn to_bits32(self) -> u32 {
        u32::from(self.to_bits())
    }
}

/// Element values from their bits.
pub fn from_bits<T: Bits>(bits: &[u32]) -> Vec<T> {
    bits.iter().map(|&b| T::from_bits32(b)).collect()
}

/// The bits of element values.
pub fn to_bits<T: Bits>(values: &[T]) -> Vec<u32> {
    values.iter().map(|v| v.to_bits32()).collect()
}

/// What outputs are filled with before a run: a finite, non-zero value of
/// every dtype (not NaN, which would match any NaN result), so an element
/// the kernel never writes shows up as a mismatch.
pub fn poison_bits(dtype: Dtype) -> u32 {
    match dtype {
        Dtype::F32 => 0xC2F1_5A5A,
        Dtype::F16 | Dtype::Bf16 => 0xD15A,
    }
}

/// Message lengths (elements) of a full sweep: empty, below one pack, pack
/// multiples and their neighbours, one block's worth, many blocks.
pub const LENGTHS: &[usize] = &[
    0, 1, 3, 4, 7, 8, 9, 15, 17, 100, 511, 4096, 4099, 65_537, 262_147,
];

/// Lengths of a quick sweep (`check --quick`).
pub const QUICK_LENGTHS: &[usize] = &[0, 1, 7, 9, 100, 4099, 65_537];

/// One validation case.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Case {
    pub dtype: Dtype,
    pub world: usize,
    /// Elements per rank.
    pub len: usize,
    pub algo: AlgoChoice,
    /// Registered (zero-copy) inputs instead of staged ones. Virtual groups
    /// only: [`run_peer`] always stages.
    pub registered: bool,
    /// Seed of the adversarial inputs.
    pub seed: u64,
}

/// `check`'s name for an algorithm choice.
pub fn algo_name(a: AlgoChoice) -> &'static str {
    match a {
        AlgoChoice::Auto => "auto",
        AlgoChoice::OneStage => "one_stage",
        AlgoChoice::TwoStage => "two_stage",
        AlgoChoice::Push => "push",
        AlgoChoice::PushLl => "push_ll",
        AlgoChoice::PushTwoStage => "push_two_stage",
        AlgoChoice::PushIslands => "push_islands",
    }
}

/// Parses `one_stage`, `two_stage`, `push`, `push_ll`, `push_two_stage`,
/// `push_islands` or `auto` (also `1`, `2`, `one`, `two`, `ll`, `push2`,
/// `islands`).
pub fn parse_algo(s: &str) -> Option<AlgoChoice> {
    match s.trim().to_ascii_lowercase().replace('-', "_").as_str() {
        "auto" => Some(AlgoChoice::Auto),
        "one_stage" | "one" | "1" | "onestage" => Some(AlgoChoice::OneStage),
        "two_stage" | "two" | "2" | "twostage" => Some(AlgoChoice::TwoStage),
        "push" => Some(AlgoChoice::Push),
        "push_ll" | "pushll" | "ll" => Some(AlgoChoice::PushLl),
        "push_two_stage" | "push2" => Some(AlgoChoice::PushTwoStage),
        "push_islands" | "islands" => Some(AlgoChoice::PushIslands),
        _ => None,
    }
}

/// Parses `f32`, `f16` or `bf16` (also `float`, `half`, `bfloat16`).
pub fn parse_dtype(s: &str) -> Option<Dtype> {
    match s.trim().to_ascii_lowercase().as_str() {
        "f32" | "float" | "float32" => Some(Dtype::F32),
        "f16" | "half" | "float16" => Some(Dtype::F16),
        "bf16" | "bfloat16" => Some(Dtype::Bf16),
        _ => None,
    }
}

impl fmt::Display for Case {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} world {} len {} {} {} seed {}",
            self.dtype.name(),
            self.world,
            self.len,
            algo_name(self.algo),
            if self.registered {
                "registered"
            } else {
                "staged"
            },
            self.seed
        )
    }
}

/// The cases of a sweep, in a fixed order: for each world, dtype, algorithm
/// and length. Registered and staged inputs alternate over the lengths
/// (when `registered_too`); each case has its own seed. `skip_empty` drops
/// zero-length cases (the peer-group path takes `CudaSlice`s, which cannot
/// be empty).
pub fn sweep(
    dtypes: &[Dtype],
    worlds: &[usize],
    lengths: &[usize],
    algos: &[AlgoChoice],
    registered_too: bool,
    skip_empty: bool,
) -> Vec<Case> {
    let mut v = Vec::new();
    for &world in worlds {
        for &dtype in dtypes {
            for &algo in algos {
                for (k, &len) in lengths.iter().enumerate() {
                    if skip_empty && len == 0 {
                        continue;
                    }
                    v.push(Case {
                        dtype,
                        world,
                        len,
                        algo,
                        registered: registered_too && k % 2 == 1,
                        seed: (world * 1000 + k) as u64 * 16 + dtype as u64 * 4 + algo as u64,
                    });
                }
            }
        }
    }
    v
}

/// The first wrong element of a run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Mismatch {
    pub dtype: Dtype,
    pub rank: usize,
    pub index: usize,
    pub got: u32,
    pub want: u32,
    /// Every rank's input at `index`, when known.
    pub inputs: Vec<u32>,
}

impl fmt::Display for Mismatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "rank {} element {}: got {}, want {}",
            self.rank,
            self.index,
            reference::fmt_bits(self.dtype, self.got),
            reference::fmt_bits(self.dtype, self.want)
        )?;
        if !self.inputs.is_empty() {
            let ins: Vec<String> = self.inputs.iter().map(|b| format!("{b:#x}")).collect();
            write!(f, "; inputs [{}]", ins.join(", "))?;
        }
        Ok(())
    }
}

/// What one validated run gave.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Outcome {
    /// The algorithm the group ran.
    pub used: Algorithm,
    /// Wrong elements, summed over all ranks (nccl-tests' `#wrong`).
    pub wrong: usize,
    pub first: Option<Mismatch>,
}

impl Outcome {
    pub fn passed(&self) -> bool {
        self.wrong == 0
    }
}

/// Counts the elements of `got` (rank `rank`'s result) that differ from
/// `want` in the sense of [`reference::same_value`], keeping the first one.
/// A result of the wrong length counts every missing or extra element.
pub fn compare_rank(
    dtype: Dtype,
    rank: usize,
    got: &[u32],
    want: &[u32],
    wrong: &mut usize,
    first: &mut Option<Mismatch>,
) {
    let n = got.len().min(want.len());
    if first.is_none() {
        if let Some((index, g, w)) = reference::first_mismatch(dtype, &got[..n], &want[..n]) {
            *first = Some(Mismatch {
                dtype,
                rank,
                index,
                got: g,
                want: w,
                inputs: Vec::new(),
            });
        }
    }
    *wrong += got[..n]
        .iter()
        .zip(&want[..n])
        .filter(|(&g, &w)| !reference::same_value(dtype, g, w))
        .count();
    *wrong += got.len().abs_diff(want.len());
}

/// Counts the elements of rank `rank`'s result whose raw bits differ from
/// rank 0's (`rank0`), keeping the first one (reported with rank 0's bits
/// as `want`).
pub fn compare_identical(
    dtype: Dtype,
    rank: usize,
    got: &[u32],
    rank0: &[u32],
    wrong: &mut usize,
    first: &mut Option<Mismatch>,
) {
    for (index, (&g, &w)) in got.iter().zip(rank0).enumerate() {
        if g != w {
            *wrong += 1;
            first.get_or_insert(Mismatch {
                dtype,
                rank,
                index,
                got: g,
                want: w,
                inputs: Vec::new(),
            });
        }
    }
}

/// A hash of a result's raw bits, for comparing ranks in other processes.
pub fn bits_hash(bits: &[u32]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bits {
        for byte in b.to_le_bytes() {
            h = (h ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3);
        }
    }
    h
}

mod run;
pub use run::{
    bench_fill, check_registered_fill, reference_for_fill, run_peer, run_process, run_virtual,
};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn poison_is_finite_nonzero_and_not_nan() {
        for dtype in Dtype::ALL {
            let p = poison_bits(dtype);
            assert!(!reference::is_nan(dtype, p));
            let v = reference::widen(dtype, p);
            assert!(v.is_finite() && v != 0.0, "{dtype:?}: {v}");
        }
    }

    #[test]
    fn compare_counts_every_wrong_element() {
        let want = vec![1u32, 2, 3, 4];
        let (mut wrong, mut first) = (0, None);
        compare_rank(Dtype::F32, 0, &want, &want, &mut wrong, &mut first);
        assert_eq!((wrong, &first), (0, &None));
        compare_rank(Dtype::F32, 1, &[1, 9, 3, 8], &want, &mut wrong, &mut first);
        assert_eq!(wrong, 2);
        let m = first.clone().expect("mismatch");
        assert_eq!((m.rank, m.index, m.got, m.want), (1, 1, 9, 2));
        // A shorter result counts the missing elements; the first mismatch stays.
        compare_rank(Dtype::F32, 2, &[1, 2], &want, &mut wrong, &mut first);
        assert_eq!(wrong, 4);
        assert_eq!(first.map(|m| m.rank), Some(1));
    }

    #[test]
    fn any_nan_matches_any_nan() {
        let (mut wrong, mut first) = (0, None);
        compare_rank(Dtype::Bf16, 0, &[0x7fc1], &[0xffc0], &mut wrong, &mut first);
        assert_eq!(wrong, 0);
    }

    #[test]
    fn sweep_is_deterministic_and_complete() {
        let a = sweep(
            &Dtype::ALL,
            &[2, 8],
            QUICK_LENGTHS,
            &[AlgoChoice::OneStage, AlgoChoice::TwoStage],
            true,
            false,
        );
        assert_eq!(a.len(), 2 * 3 * 2 * QUICK_LENGTHS.len());
        assert!(a.iter().any(|c| c.registered) && a.iter().any(|c| !c.registered));
        let seeds: std::collections::HashSet<u64> = a.iter().map(|c| c.seed).collect();
        assert_eq!(seeds.len(), a.len(), "every case has its own seed");
        let b = sweep(
            &Dtype::ALL,
            &[2],
            QUICK_LENGTHS,
            &[AlgoChoice::Auto],
            false,
            true,
        );
        assert!(b.iter().all(|c| c.len > 0 && !c.registered));
    }

    #[test]
    fn fill_is_a_prefix_and_finite() {
        let long = bench_fill(Dtype::Bf16, 5000, 1);
        let short = bench_fill(Dtype::Bf16, 100, 1);
        assert_eq!(&long[..100], &short[..]);
        assert!(long.iter().any(|&b| b != 0), "fill must not be all zeros");
        let want = reference_for_fill(Dtype::Bf16, &long, 8);
        assert!(want
            .iter()
            .all(|&b| reference::widen(Dtype::Bf16, b).is_finite()));
        let refs = vec![long.as_slice(); 8];
        assert_eq!(want, reference::allreduce_bits(Dtype::Bf16, &refs));
    }

    #[test]
    fn names_round_trip() {
        for a in [
            AlgoChoice::Auto,
            AlgoChoice::OneStage,
            AlgoChoice::TwoStage,
            AlgoChoice::Push,
            AlgoChoice::PushLl,
        ] {
            assert_eq!(parse_algo(algo_name(a)), Some(a));
        }
        for d in Dtype::ALL {
            assert_eq!(parse_dtype(d.name()), Some(d));
        }
        assert_eq!(parse_algo("three"), None);
        assert_eq!(parse_dtype("int8"), None);
    }

    #[test]
    fn case_display_names_everything() {
        let c = Case {
            dtype: Dtype::F16,
            world: 3,
            len: 17,
            algo: AlgoChoice::TwoStage,
            registered: true,
            seed: 5,
        };
        assert_eq!(
            c.to_string(),
            "f16 world 3 len 17 two_stage registered seed 5"
        );
    }
}
