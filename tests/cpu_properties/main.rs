//! Property tests of the kernels' pure pieces against the CPU oracle. No GPU.
//!
//! The kernel model below is assembled only from the device crate's pure
//! functions (`reduce_pack`, `reduce_scalar`, `split`, `partition`, the
//! `Element` conversions), fed with rank data laid out byte for byte as in
//! GPU memory, and walked with the kernels' grid-stride decomposition. One
//! case generator ([`case`]) is swept over dtype x algorithm x world x length
//! x launch grid; every case is checked against `p2p_allreduce::reference`,
//! which is written independently of the device crate.
//!
//! One test target, `cpu_properties`: this file holds the cases and the
//! GPU memory images every family uses; the tests are by kernel family:
//! [`allreduce`] (the allreduce kernels' model against the oracle),
//! [`partition`] (the work decomposition), [`conversions`] (the element
//! conversions against the `half` crate), [`norm`] (the fused RMSNorm's
//! sum of squares).

use std::fmt;

use p2p_allreduce::abi::{island_split, Algorithm, Dtype, MAX_BLOCKS, MAX_RANKS, PACK_BYTES};
use p2p_allreduce::device::numeric::{
    bf16_bits_from_f32, bf16x2_from_f32, f16_bits_from_f32, f16x2_from_f32, f16x2_to_f32,
    f32_from_f16_bits, Bf16, Element, Pack, F16, F32,
};
use p2p_allreduce::device::reduce::{
    accumulate, partial_from_packs, partial_to_packs, partition, reduce_pack, reduce_pack_dyn,
    reduce_scalar, split,
};
use p2p_allreduce::ll;
use p2p_allreduce::reference::{self, as_slices, fmt_bits, values};
use proptest::prelude::*;
use proptest::sample::select;

mod allreduce;
mod conversions;
mod norm;
mod partition;
mod routing;

// ---------------------------------------------------------------------------
// Cases

/// One allreduce to model: what is reduced, by how many ranks, with which
/// algorithm, and on which launch grid.
#[derive(Clone, Debug)]
struct Case {
    dtype: Dtype,
    algo: Algorithm,
    world: usize,
    len: usize,
    seed: u64,
    specials: bool,
    grid: Grid,
}

/// The part of the launch shape that decides which thread touches which
/// pack: `blocks` x `threads` threads per rank, grid-stride loops.
#[derive(Clone, Copy, Debug)]
struct Grid {
    blocks: usize,
    threads: usize,
}

impl fmt::Display for Case {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} {} world={} len={} seed={:#x} specials={} grid={}x{}",
            self.dtype.name(),
            self.algo.name(),
            self.world,
            self.len,
            self.seed,
            self.specials,
            self.grid.blocks,
            self.grid.threads
        )
    }
}

impl Case {
    fn inputs(&self) -> Vec<Vec<u32>> {
        values::adversarial_inputs(self.dtype, self.world, self.len, self.seed, self.specials)
    }
}

/// Lengths around every boundary the decomposition has: empty, shorter
/// than one pack, whole packs plus or minus one element, and a spread of
/// sizes that give partitions of unequal length.
fn small_len() -> impl Strategy<Value = usize> {
    prop_oneof![
        3 => 0usize..=40,
        3 => (1usize..800, -1isize..=1).prop_map(|(k, d)| (k as isize * 8 + d) as usize),
        2 => (1usize..400).prop_map(|k| 2 * k + 1),
        2 => 0usize..20_000,
    ]
}

/// About a million elements, odd and not a multiple of any pack width.
fn large_len() -> impl Strategy<Value = usize> {
    (0usize..64).prop_map(|k| (1 << 20) - 64 + 2 * k + 1)
}

fn grid() -> impl Strategy<Value = Grid> {
    // Whole warps, as every real launch uses; the blocks range covers the
    // signal layout's limit.
    (
        1usize..=MAX_BLOCKS,
        select(vec![32usize, 64, 128, 256, 512, 1024]),
    )
        .prop_map(|(blocks, threads)| Grid { blocks, threads })
}

/// The one case generator every model property is swept with.
fn case(len: impl Strategy<Value = usize>) -> impl Strategy<Value = Case> {
    (
        select(Dtype::ALL.to_vec()),
        select(Algorithm::ALL.to_vec()),
        1usize..=MAX_RANKS,
        len,
        any::<u64>(),
        prop::bool::weighted(0.7),
        grid(),
    )
        .prop_map(|(dtype, algo, world, len, seed, specials, grid)| Case {
            dtype,
            algo,
            world,
            len,
            seed,
            specials,
            grid,
        })
}

fn config(cases: u32) -> ProptestConfig {
    ProptestConfig {
        cases,
        // The case's own seed reproduces it; no regression files in the tree.
        failure_persistence: None,
        max_shrink_iters: 200,
        ..ProptestConfig::default()
    }
}

/// For cases of a million elements: shrinking would rerun them hundreds of
/// times, and the failure message already names the case and element.
fn config_no_shrink(cases: u32) -> ProptestConfig {
    ProptestConfig {
        max_shrink_iters: 0,
        ..config(cases)
    }
}

// ---------------------------------------------------------------------------
// GPU memory images

/// Rank data as the bytes a GPU buffer holds: elements little-endian, one
/// after the other (for 16-bit types, element 2k in the low half of word k).
fn to_bytes(dtype: Dtype, elems: &[u32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(elems.len() * dtype.size());
    for &e in elems {
        match dtype.size() {
            4 => out.extend_from_slice(&e.to_le_bytes()),
            _ => out.extend_from_slice(&(e as u16).to_le_bytes()),
        }
    }
    out
}

fn from_bytes(dtype: Dtype, bytes: &[u8]) -> Vec<u32> {
    bytes
        .chunks_exact(dtype.size())
        .map(|c| match c.len() {
            4 => u32::from_le_bytes([c[0], c[1], c[2], c[3]]),
            _ => u16::from_le_bytes([c[0], c[1]]) as u32,
        })
        .collect()
}

/// Pack `i` as a 16-byte vector load sees it: four little-endian words.
fn load_pack(buf: &[u8], i: u64) -> Pack {
    let b = &buf[i as usize * PACK_BYTES..][..PACK_BYTES];
    core::array::from_fn(|k| {
        u32::from_le_bytes([b[4 * k], b[4 * k + 1], b[4 * k + 2], b[4 * k + 3]])
    })
}

fn store_pack(buf: &mut [u8], i: u64, p: Pack) {
    let b = &mut buf[i as usize * PACK_BYTES..][..PACK_BYTES];
    for (k, w) in p.iter().enumerate() {
        b[4 * k..4 * k + 4].copy_from_slice(&w.to_le_bytes());
    }
}

fn load_elem<E: Element>(buf: &[u8], idx: u64) -> u32 {
    let s = E::DTYPE.size();
    from_bytes(E::DTYPE, &buf[idx as usize * s..][..s])[0]
}

fn store_elem<E: Element>(buf: &mut [u8], idx: u64, bits: u32) {
    let s = E::DTYPE.size();
    buf[idx as usize * s..][..s].copy_from_slice(&to_bytes(E::DTYPE, &[bits]));
}
