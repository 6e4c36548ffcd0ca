//! Running validation cases on the three group kinds, and the data and
//! check behind `bench`'s `#wrong` column.

use super::{
    bits_hash, compare_identical, compare_rank, from_bits, poison_bits, to_bits, Bits, Case,
    Mismatch, Outcome,
};
use crate::abi::{Algorithm, Dtype};
use crate::error::{Context as _, Error, Result};
use crate::exchange::Exchange;
use crate::plan::AlgoChoice;
use crate::reference::{self, values};
use crate::{PeerGroup, ProcessGroup, VirtualGroup};
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
use std::sync::Arc;

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
