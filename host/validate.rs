//! Validation cases: run one allreduce on real buffers and compare every
//! rank's result with the CPU reference ([`crate::reference`]) bit for bit.
//! Shared by `p2p-allreduce check`, the `#wrong` column of
//! `p2p-allreduce bench`, and tests.
//!
//! Inputs come from [`values::adversarial_inputs`] (seeded, so a failing
//! case is reproduced by its [`Case`] alone); outputs are filled with a
//! poison value before the run, so a kernel that skips an element is caught.
//! Device errors (a peer timeout recorded by the kernels, a driver error) are
//! returned as `Err`; wrong bits are an `Ok` [`Outcome`] with `wrong > 0`.

use crate::abi::{Algorithm, Dtype};
use crate::element::DeviceElement;
use crate::error::{Context as _, Error, Result};
use crate::exchange::Exchange;
use crate::plan::AlgoChoice;
use crate::reference::{self, values};
use crate::ProcessGroup;
use crate::{PeerGroup, VirtualGroup};
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
use std::fmt;
use std::sync::Arc;

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
    }
}

/// Parses `one_stage`, `two_stage` or `auto` (also `1`, `2`, `one`, `two`).
pub fn parse_algo(s: &str) -> Option<AlgoChoice> {
    match s.trim().to_ascii_lowercase().replace('-', "_").as_str() {
        "auto" => Some(AlgoChoice::Auto),
        "one_stage" | "one" | "1" | "onestage" => Some(AlgoChoice::OneStage),
        "two_stage" | "two" | "2" | "twostage" => Some(AlgoChoice::TwoStage),
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

/// Fills a new device buffer of `len.max(1)` elements with the poison value.
fn poisoned<T: Bits>(stream: &Arc<CudaStream>, len: usize) -> Result<CudaSlice<T>> {
    let host = vec![T::from_bits32(poison_bits(T::DTYPE)); len.max(1)];
    stream
        .clone_htod(&host)
        .during("cuMemcpyHtoD (poisoned output)")
}

/// Uploads element bits (at least one element: cudarc cannot allocate none).
fn upload<T: Bits>(stream: &Arc<CudaStream>, bits: &[u32]) -> Result<CudaSlice<T>> {
    let host: Vec<T> = if bits.is_empty() {
        vec![T::from_bits32(poison_bits(T::DTYPE))]
    } else {
        from_bits(bits)
    };
    stream.clone_htod(&host).during("cuMemcpyHtoD (input)")
}

/// The first `len` elements of a device buffer, as bits.
fn download<T: Bits>(stream: &Arc<CudaStream>, s: &CudaSlice<T>, len: usize) -> Result<Vec<u32>> {
    let v = stream.clone_dtoh(s).during("cuMemcpyDtoH (output)")?;
    Ok(to_bits(&v[..len.min(v.len())]))
}

fn check_world(case: &Case, world: usize) -> Result<()> {
    if case.world != world {
        return Err(Error::RankCount {
            what: "ranks in the validation case",
            got: case.world,
            world,
        });
    }
    Ok(())
}

/// Compares every rank's output with the reference and attaches the input
/// column to the first mismatch.
fn judge(
    dtype: Dtype,
    used: Algorithm,
    inputs: &[Vec<u32>],
    want: &[u32],
    outputs: &[Vec<u32>],
) -> Outcome {
    let mut wrong = 0;
    let mut first = None;
    for (rank, got) in outputs.iter().enumerate() {
        compare_rank(dtype, rank, got, want, &mut wrong, &mut first);
    }
    // Every rank must hold identical bits (NaN payloads too), beyond
    // matching the reference value.
    for (rank, got) in outputs.iter().enumerate().skip(1) {
        compare_identical(dtype, rank, got, &outputs[0], &mut wrong, &mut first);
    }
    if let Some(m) = first.as_mut() {
        m.inputs = inputs
            .iter()
            .filter_map(|x| x.get(m.index).copied())
            .collect();
    }
    Outcome { used, wrong, first }
}

/// Runs `case` on a [`VirtualGroup`] (all ranks in one launch on `stream`)
/// and checks every rank against the reference. Waits for the stream.
pub fn run_virtual(group: &VirtualGroup, stream: &Arc<CudaStream>, case: &Case) -> Result<Outcome> {
    check_world(case, group.world())?;
    match case.dtype {
        Dtype::F32 => run_virtual_typed::<f32>(group, stream, case),
        Dtype::F16 => run_virtual_typed::<half::f16>(group, stream, case),
        Dtype::Bf16 => run_virtual_typed::<half::bf16>(group, stream, case),
    }
}

fn run_virtual_typed<T: Bits>(
    group: &VirtualGroup,
    stream: &Arc<CudaStream>,
    case: &Case,
) -> Result<Outcome> {
    let (world, len) = (case.world, case.len);
    let inputs = values::adversarial_inputs(case.dtype, world, len, case.seed, true);
    let want = reference::allreduce_bits(case.dtype, &reference::as_slices(&inputs));
    let mut outputs = (0..world)
        .map(|_| poisoned::<T>(stream, len))
        .collect::<Result<Vec<_>>>()?;
    // Kept alive until the stream is done with them.
    let ins = inputs
        .iter()
        .map(|b| upload::<T>(stream, b))
        .collect::<Result<Vec<_>>>()?;
    let used = if case.registered {
        let reg = group.alloc_registered::<T>(len.max(1))?;
        if len > 0 {
            for (r, src) in ins.iter().enumerate() {
                reg.copy_from(r, stream, src)?;
            }
        }
        let used = group.allreduce_registered(stream, &reg, len, &mut outputs, case.algo)?;
        group.check(stream)?;
        used
    } else if len == 0 {
        // Empty slices cannot be allocated: the raw entry point with count 0.
        let out_ptrs: Vec<u64> = outputs
            .iter_mut()
            .map(|o| o.device_ptr_mut(stream).0)
            .collect();
        let in_ptrs: Vec<u64> = ins.iter().map(|i| i.device_ptr(stream).0).collect();
        // SAFETY: no element is read or written for count 0; the pointers
        // are live allocations of this stream's context.
        let used =
            unsafe { group.allreduce_raw(stream, case.dtype, 0, &in_ptrs, &out_ptrs, case.algo) }?;
        group.check(stream)?;
        used
    } else {
        let refs: Vec<&CudaSlice<T>> = ins.iter().collect();
        let used = group.allreduce(stream, &refs, &mut outputs, case.algo)?;
        group.check(stream)?;
        used
    };
    let got = outputs
        .iter()
        .map(|o| download(stream, o, len))
        .collect::<Result<Vec<_>>>()?;
    Ok(judge(case.dtype, used, &inputs, &want, &got))
}

/// Runs `case` on a [`PeerGroup`]: rank r's input and output live on
/// `streams[r]`'s device and it launches on that stream; registered cases
/// use the group's zero-copy buffers, empty ones the raw entry point.
/// Waits for every stream.
pub fn run_peer(group: &PeerGroup, streams: &[Arc<CudaStream>], case: &Case) -> Result<Outcome> {
    check_world(case, group.world())?;
    if streams.len() != case.world {
        return Err(Error::RankCount {
            what: "streams",
            got: streams.len(),
            world: case.world,
        });
    }
    match case.dtype {
        Dtype::F32 => run_peer_typed::<f32>(group, streams, case),
        Dtype::F16 => run_peer_typed::<half::f16>(group, streams, case),
        Dtype::Bf16 => run_peer_typed::<half::bf16>(group, streams, case),
    }
}

fn run_peer_typed<T: Bits>(
    group: &PeerGroup,
    streams: &[Arc<CudaStream>],
    case: &Case,
) -> Result<Outcome> {
    let len = case.len;
    let inputs = values::adversarial_inputs(case.dtype, case.world, len, case.seed, true);
    let want = reference::allreduce_bits(case.dtype, &reference::as_slices(&inputs));
    // Uploads and poison are on each rank's own stream, ahead of its copy
    // and launch; the kernels' Start barrier orders peers' reads after them.
    let ins = inputs
        .iter()
        .zip(streams)
        .map(|(b, s)| upload::<T>(s, b))
        .collect::<Result<Vec<_>>>()?;
    let mut outputs = streams
        .iter()
        .map(|s| poisoned::<T>(s, len))
        .collect::<Result<Vec<_>>>()?;
    let used = if case.registered {
        let reg = group.alloc_registered::<T>(len.max(1))?;
        if len > 0 {
            for (r, src) in ins.iter().enumerate() {
                reg.copy_from(r, &streams[r], src)?;
            }
        }
        let used = group.allreduce_registered(streams, &reg, len, &mut outputs, case.algo)?;
        group.check(streams)?;
        used
    } else if len == 0 {
        let out_ptrs: Vec<u64> = outputs
            .iter_mut()
            .zip(streams)
            .map(|(o, s)| o.device_ptr_mut(s).0)
            .collect();
        let in_ptrs: Vec<u64> = ins
            .iter()
            .zip(streams)
            .map(|(i, s)| i.device_ptr(s).0)
            .collect();
        // SAFETY: no element is read or written for count 0; the pointers
        // are live allocations on each rank's device.
        let used =
            unsafe { group.allreduce_raw(streams, case.dtype, 0, &in_ptrs, &out_ptrs, case.algo) }?;
        group.check(streams)?;
        used
    } else {
        let refs: Vec<&CudaSlice<T>> = ins.iter().collect();
        let used = group.allreduce(streams, &refs, &mut outputs, case.algo)?;
        group.check(streams)?;
        used
    };
    let got = outputs
        .iter()
        .zip(streams)
        .map(|(o, s)| download(s, o, len))
        .collect::<Result<Vec<_>>>()?;
    Ok(judge(case.dtype, used, &inputs, &want, &got))
}

/// Runs this process's rank of `case` on a [`ProcessGroup`] (staged input,
/// raw entry for empty cases) and compares its result with the reference;
/// then the ranks compare hashes of their results through `exchange`, so a
/// rank whose bits differ from rank 0's is counted too. Every rank calls it
/// with the same case.
pub fn run_process(
    group: &ProcessGroup,
    exchange: &dyn Exchange,
    stream: &Arc<CudaStream>,
    case: &Case,
) -> Result<Outcome> {
    check_world(case, group.world())?;
    match case.dtype {
        Dtype::F32 => run_process_typed::<f32>(group, exchange, stream, case),
        Dtype::F16 => run_process_typed::<half::f16>(group, exchange, stream, case),
        Dtype::Bf16 => run_process_typed::<half::bf16>(group, exchange, stream, case),
    }
}

fn run_process_typed<T: Bits>(
    group: &ProcessGroup,
    exchange: &dyn Exchange,
    stream: &Arc<CudaStream>,
    case: &Case,
) -> Result<Outcome> {
    let (rank, len) = (group.rank(), case.len);
    let inputs = values::adversarial_inputs(case.dtype, case.world, len, case.seed, true);
    let want = reference::allreduce_bits(case.dtype, &reference::as_slices(&inputs));
    let run = || -> Result<(Algorithm, Vec<u32>)> {
        let input = upload::<T>(stream, &inputs[rank])?;
        let mut output = poisoned::<T>(stream, len)?;
        let used = if len == 0 {
            let o = output.device_ptr_mut(stream).0;
            let i = input.device_ptr(stream).0;
            // SAFETY: no element is read or written for count 0.
            unsafe { group.allreduce_raw(stream, case.dtype, 0, i, o, case.algo) }?
        } else {
            group.allreduce(stream, &input, &mut output, case.algo)?
        };
        group.check(stream)?;
        Ok((used, download(stream, &output, len)?))
    };
    let result = run();
    // Every rank takes part in this exchange whatever happened, so that the
    // ranks stay in step: a failed rank makes the case fail on every rank.
    let mut mine = vec![u8::from(result.is_ok())];
    let hash = result.as_ref().map_or(0, |(_, got)| bits_hash(got));
    mine.extend_from_slice(&hash.to_le_bytes());
    let all = exchange.all_gather(&mine)?;
    let (used, got) = result?;
    if let Some(p) = all.iter().position(|b| b.first() != Some(&1)) {
        return Err(Error::Rendezvous(format!(
            "rank {p} failed this case (its own output says why)"
        )));
    }
    let mut wrong = 0;
    let mut first = None;
    compare_rank(case.dtype, rank, &got, &want, &mut wrong, &mut first);
    if all[rank] != all[0] {
        // Same values as the reference, other bits than rank 0 (NaN payloads).
        wrong += 1;
        first.get_or_insert(Mismatch {
            dtype: case.dtype,
            rank,
            index: 0,
            got: got.first().copied().unwrap_or(0),
            want: want.first().copied().unwrap_or(0),
            inputs: vec![],
        });
    }
    if let Some(m) = first.as_mut() {
        m.inputs = inputs
            .iter()
            .filter_map(|x| x.get(m.index).copied())
            .collect();
    }
    Ok(Outcome { used, wrong, first })
}

/// Benchmark data: `len` non-trivial finite values of `dtype` (adversarial
/// values without inf/NaN, so that sums of up to 8 ranks stay finite). The
/// data for a length is a prefix of the data for any longer length with the
/// same seed, so one buffer serves every size of a sweep.
pub fn bench_fill(dtype: Dtype, len: usize, seed: u64) -> Vec<u32> {
    values::adversarial_inputs(dtype, 1, len, seed, false)
        .pop()
        .unwrap_or_default()
}

/// The reference result of `world` ranks that all hold `fill` (the layout of
/// [`crate::measure::time_registered`]), computed in chunks so memory stays
/// small for large messages.
pub fn reference_for_fill(dtype: Dtype, fill: &[u32], world: usize) -> Vec<u32> {
    const CHUNK: usize = 1 << 20;
    let mut want = Vec::with_capacity(fill.len());
    for chunk in fill.chunks(CHUNK) {
        let ranks = vec![chunk; world.max(1)];
        want.extend(reference::allreduce_bits(dtype, &ranks));
    }
    want
}

/// Runs once the allreduce that [`crate::measure::time_registered`] times —
/// registered inputs holding `fill` on every rank, `count` elements, `algo`
/// — into poisoned outputs, and compares every rank with `want` (from
/// [`reference_for_fill`] on the same data). This is how `bench` fills its
/// `#wrong` column.
pub fn check_registered_fill<T: Bits>(
    group: &VirtualGroup,
    stream: &Arc<CudaStream>,
    fill: &[T],
    want: &[u32],
    algo: AlgoChoice,
) -> Result<Outcome> {
    let count = fill.len();
    if want.len() != count {
        return Err(Error::Config(format!(
            "check_registered_fill: {} reference elements for {count} inputs",
            want.len()
        )));
    }
    let world = group.world();
    let reg = group.alloc_registered::<T>(count.max(1))?;
    let src = if count > 0 {
        let src = stream
            .clone_htod(fill)
            .during("cuMemcpyHtoD (bench input)")?;
        for r in 0..world {
            reg.copy_from(r, stream, &src)?;
        }
        Some(src)
    } else {
        None
    };
    let mut outputs = (0..world)
        .map(|_| poisoned::<T>(stream, count))
        .collect::<Result<Vec<_>>>()?;
    let used = group.allreduce_registered(stream, &reg, count, &mut outputs, algo)?;
    group.check(stream)?;
    drop(src);
    let mut wrong = 0;
    let mut first = None;
    for (rank, o) in outputs.iter().enumerate() {
        let got = download(stream, o, count)?;
        compare_rank(T::DTYPE, rank, &got, want, &mut wrong, &mut first);
    }
    if let Some(m) = first.as_mut() {
        m.inputs = vec![fill[m.index].to_bits32(); world];
    }
    Ok(Outcome { used, wrong, first })
}

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
        for a in [AlgoChoice::Auto, AlgoChoice::OneStage, AlgoChoice::TwoStage] {
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
